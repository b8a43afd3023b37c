// SPDX-License-Identifier: MIT
// A program that uses an installed weft: the JIT finds weft's headers and kernels from the install prefix
// (no WEFT_HOME) and compiles a kernel for sm_90a without a GPU; with a GPU it also makes a world of one rank
// and runs that kernel, and a kernel of this project's own (device_check.cu, nvcc on weft's device layer). Exits
// non-zero when any step fails.
//
//   weft_install_check [--expect-prefix DIR]   DIR: the prefix the roots must be found in
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "device_check.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/jit/paths.hpp"
#include "weft/weft.hpp"

namespace {

namespace fs = std::filesystem;

weft::jit::KernelSpec saxpy_spec(const std::string& arch) {
    weft::jit::KernelSpec spec;
    spec.header = "jit_selftest/saxpy.cuh";
    spec.instantiation = "weft::kernels::jit_selftest::saxpy<weft::kernels::jit_selftest::SaxpyConfig{"
                         ".items_per_thread = 2, .redundant_passes = 1}>";
    spec.description = "saxpy items_per_thread=2";
    spec.arch = arch;
    return spec;
}

bool same_dir(const fs::path& a, const fs::path& b) {
    std::error_code ec;
    return fs::equivalent(a, b, ec);
}

// y = 2 x + y + rank on the GPU through the JIT; checks every element.
void run_on_the_gpu(weft::jit::Compiler& compiler) {
    auto world = weft::World::from_env();
    std::printf("world: rank %d of %d on device %d\n", world->rank(), world->num_ranks(), world->device());
    weft::jit::Kernel& kernel = compiler.get_kernel(saxpy_spec(""));
    constexpr int kN = 1 << 16;
    std::vector<float> x(kN), y(kN);
    for (int i = 0; i < kN; ++i) {
        x[i] = static_cast<float>(i % 97);
        y[i] = static_cast<float>(i % 13);
    }
    float* dx = nullptr;
    float* dy = nullptr;
    WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dx), kN * sizeof(float)));
    WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dy), kN * sizeof(float)));
    WEFT_CUDA_CHECK(cudaMemcpy(dx, x.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
    WEFT_CUDA_CHECK(cudaMemcpy(dy, y.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
    kernel.launch({.grid = dim3(64), .block = dim3(128)}, world->device_ctx(), 2.0f, static_cast<const float*>(dx),
                  dy, kN);
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> out(kN);
    WEFT_CUDA_CHECK(cudaMemcpy(out.data(), dy, kN * sizeof(float), cudaMemcpyDeviceToHost));
    WEFT_CUDA_CHECK(cudaFree(dx));
    WEFT_CUDA_CHECK(cudaFree(dy));
    for (int i = 0; i < kN; ++i) {
        const float expected = 2.0f * x[i] + y[i] + static_cast<float>(world->rank());
        WEFT_CHECK(out[i] == expected, "saxpy on the GPU: y[" << i << "] is " << out[i] << ", expected " << expected);
    }
    std::printf("ran %s on the GPU: %d elements correct\n", saxpy_spec("").description.c_str(), kN);
    const int own = device_layer_check(world->device_ctx());
    WEFT_CHECK(own == 64, "the project's own kernel on weft's device layer: " << own << " of 64 threads right");
    std::printf("ran this project's own nvcc kernel on weft's device layer: 64 threads correct\n");
}

}  // namespace

int main(int argc, char** argv) {
    fs::path expect_prefix;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--expect-prefix") == 0 && i + 1 < argc) {
            expect_prefix = argv[++i];
        } else {
            std::fprintf(stderr, "usage: %s [--expect-prefix DIR]\n", argv[0]);
            return 2;
        }
    }
    try {
        std::printf("weft %s\n", WEFT_VERSION_STRING);
        const weft::jit::IncludeRoots roots = weft::jit::find_include_roots();
        std::printf("weft headers: %s\nweft kernels: %s\nfound by:     %s\n", roots.weft_include.c_str(),
                    roots.weft_kernels.c_str(), roots.found_by.c_str());
        if (!expect_prefix.empty()) {
            WEFT_CHECK(same_dir(roots.weft_include, expect_prefix / "include") &&
                           same_dir(roots.weft_kernels, expect_prefix / "share/weft/kernels"),
                       "weft's roots must be " << (expect_prefix / "include").string() << " and "
                                               << (expect_prefix / "share/weft/kernels").string());
        }

        // No disk cache: this run compiles, whatever an earlier one left behind.
        weft::jit::CompilerConfig config = weft::jit::CompilerConfig::from_env();
        config.cache_dir.reset();
        weft::jit::Compiler compiler(config);
        const weft::jit::CompileResult r = compiler.compile(saxpy_spec("sm_90a"));
        WEFT_CHECK(r.origin == weft::jit::CompileResult::Origin::kCompiled, "the kernel was not compiled by this run");
        WEFT_CHECK(r.cubin && r.cubin->size() >= 4 && std::memcmp(r.cubin->data(), "\x7f" "ELF", 4) == 0,
                   "the compile produced no cubin (an ELF image)");
        std::printf("compiled %s for %s: %zu bytes of cubin, %d registers, kernel %s\n",
                    saxpy_spec("").description.c_str(), r.arch.c_str(), r.cubin->size(), r.ptxas_info.registers,
                    r.lowered_name.c_str());

        if (weft::cuda_available()) {
            run_on_the_gpu(compiler);
        } else {
            std::printf("no GPU: a World needs one, so no world of one here; the JIT compile above needs none\n");
        }
        std::printf("OK\n");
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "weft_install_check: %s\n", e.what());
        return 1;
    }
}
