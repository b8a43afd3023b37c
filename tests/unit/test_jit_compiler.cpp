// SPDX-License-Identifier: MIT
// Unit tests of the JIT compiler on the CPU: NVRTC compiles weft's kernels for sm_90a, the two cache
// layers, dependency hashing, concurrency across processes, corruption, errors, LTO and linking.
#include <gtest/gtest.h>
#include <nvrtc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "support/jit_testing.hpp"
#include "weft/jit/aot.hpp"
#include "weft/jit/cache.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/jit/paths.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"

namespace weft::jit {
namespace {

namespace fs = std::filesystem;
using weft::testing::isolated_compiler_config;
using weft::testing::read_text_file;
using weft::testing::ScopedEnv;
using weft::testing::TempDir;
using weft::testing::write_text_file;

constexpr const char* kArch = "sm_90a";

KernelSpec saxpy(int items_per_thread, int redundant_passes = 1) {
    KernelSpec spec = jit_selftest_saxpy_spec(items_per_thread, redundant_passes);
    spec.arch = kArch;
    return spec;
}

// A cubin is an ELF image for the CUDA machine (EM_CUDA = 190).
void expect_cuda_elf(const std::vector<char>& image) {
    ASSERT_GE(image.size(), 64u);
    EXPECT_EQ(std::memcmp(image.data(), "\x7f" "ELF", 4), 0) << "not an ELF image";
    const uint16_t machine = static_cast<uint16_t>(static_cast<uint8_t>(image[18]) | (static_cast<uint8_t>(image[19]) << 8));
    EXPECT_EQ(machine, 190) << "ELF machine is not EM_CUDA";
}

bool contains(const std::vector<char>& image, const std::string& text) {
    return std::search(image.begin(), image.end(), text.begin(), text.end()) != image.end();
}

// The repository's root, from this file's location (tests/unit/).
fs::path source_root() { return fs::path(__FILE__).parent_path().parent_path().parent_path(); }

TEST(JitCompiler, CompilesTheSelftestKernelForSm90a) {
    TempDir cache("weft_jit_cache");
    Compiler compiler(isolated_compiler_config(cache.path()));
    const CompileResult r = compiler.compile(saxpy(4));
    EXPECT_EQ(r.origin, CompileResult::Origin::kCompiled);
    ASSERT_TRUE(r.cubin);
    expect_cuda_elf(*r.cubin);
    EXPECT_EQ(r.arch, "sm_90a");
    EXPECT_EQ(r.key.size(), 64u);
    // The lowered name is NVRTC's, and the cubin defines that symbol.
    EXPECT_NE(r.lowered_name.find("saxpy"), std::string::npos) << r.lowered_name;
    EXPECT_NE(r.lowered_name.find("SaxpyConfig"), std::string::npos) << r.lowered_name;
    EXPECT_TRUE(contains(*r.cubin, r.lowered_name));
    // ptxas' report is always captured.
    EXPECT_GT(r.ptxas_info.registers, 0) << r.log;
    EXPECT_EQ(r.ptxas_info.spill_store_bytes, 0) << r.log;
    EXPECT_NE(r.ptxas_info.text.find(r.lowered_name), std::string::npos) << r.ptxas_info.text;
    // PTX for an sm_90a target, entry included.
    EXPECT_NE(r.ptx.find(".target sm_90a"), std::string::npos);
    EXPECT_NE(r.ptx.find(".entry " + r.lowered_name), std::string::npos);
    // Every weft header the kernel pulls in is part of the key.
    for (const char* h : {"jit_selftest/saxpy.cuh", "weft/common/device_ctx.hpp", "weft/common/diagnostics.hpp",
                          "weft/device/token.cuh"}) {
        EXPECT_NE(std::find(r.headers.begin(), r.headers.end(), h), r.headers.end()) << h;
    }
    const CompilerStats s = compiler.stats();
    EXPECT_EQ(s.compiles, 1u);
    EXPECT_EQ(s.misses, 1u);
    EXPECT_EQ(s.hits(), 0u);
    EXPECT_TRUE(fs::exists(cache / ("jit/" + r.key + ".wjit")));
}

TEST(JitCompiler, SecondCallHitsMemoryAndANewCompilerHitsDisk) {
    TempDir cache("weft_jit_cache");
    std::string key;
    std::vector<char> cubin;
    {
        Compiler compiler(isolated_compiler_config(cache.path()));
        const CompileResult first = compiler.compile(saxpy(2));
        const CompileResult second = compiler.compile(saxpy(2));
        EXPECT_EQ(first.origin, CompileResult::Origin::kCompiled);
        EXPECT_EQ(second.origin, CompileResult::Origin::kMemory);
        EXPECT_EQ(first.key, second.key);
        EXPECT_EQ(*first.cubin, *second.cubin);
        EXPECT_EQ(compiler.stats().compiles, 1u);
        EXPECT_EQ(compiler.stats().memory_hits, 1u);
        key = first.key;
        cubin = *first.cubin;
    }
    Compiler fresh(isolated_compiler_config(cache.path()));
    const CompileResult third = fresh.compile(saxpy(2));
    EXPECT_EQ(third.origin, CompileResult::Origin::kDisk);
    EXPECT_EQ(third.key, key);
    EXPECT_EQ(*third.cubin, cubin);
    EXPECT_EQ(third.lowered_name.find("saxpy") != std::string::npos, true);
    EXPECT_GT(third.ptxas_info.registers, 0) << "the ptxas report travels with the cache entry";
    EXPECT_EQ(fresh.stats().compiles, 0u);
    EXPECT_EQ(fresh.stats().disk_hits, 1u);
    EXPECT_EQ(fresh.disk_status(saxpy(2)), DiskCache::LoadStatus::kHit);
    EXPECT_EQ(fresh.disk_status(saxpy(3)), DiskCache::LoadStatus::kAbsent);
}

TEST(JitCompiler, WithoutDiskCacheOnlyMemoryHits) {
    Compiler compiler(isolated_compiler_config(fs::path()));
    EXPECT_FALSE(compiler.cache_dir().has_value());
    compiler.compile(saxpy(1));
    compiler.compile(saxpy(1));
    Compiler other(isolated_compiler_config(fs::path()));
    other.compile(saxpy(1));
    EXPECT_EQ(compiler.stats().compiles, 1u);
    EXPECT_EQ(compiler.stats().memory_hits, 1u);
    EXPECT_EQ(other.stats().compiles, 1u);
}

TEST(JitCompiler, KeyCoversConfigOptionsAndArchButNotTheDescription) {
    Compiler compiler(isolated_compiler_config(fs::path()));
    const std::string base = compiler.cache_key(saxpy(4));
    EXPECT_NE(compiler.cache_key(saxpy(8)), base);
    KernelSpec described = saxpy(4);
    described.description = "another description of the same code";
    EXPECT_EQ(compiler.cache_key(described), base);
    KernelSpec lineinfo = saxpy(4);
    lineinfo.options.lineinfo = true;
    EXPECT_NE(compiler.cache_key(lineinfo), base);
    KernelSpec regs = saxpy(4);
    regs.options.max_registers = 64;
    EXPECT_NE(compiler.cache_key(regs), base);
    KernelSpec defined = saxpy(4);
    defined.options.defines = {"WEFT_SOMETHING=1"};
    EXPECT_NE(compiler.cache_key(defined), base);
    KernelSpec preamble = saxpy(4);
    preamble.preamble = "// a comment changes the source";
    EXPECT_NE(compiler.cache_key(preamble), base);
    KernelSpec sm90 = saxpy(4);
    sm90.arch = "sm_90";
    EXPECT_NE(compiler.cache_key(sm90), base);
    // Reporting-only options do not change the code, hence not the key.
    KernelSpec verbose = saxpy(4);
    verbose.options.verbose_ptxas = true;
    verbose.options.dump_dir = "/nonexistent/dump";
    EXPECT_EQ(compiler.cache_key(verbose), base);
}

// A kernel in a temporary include root, with a header of its own that the test edits.
struct TempKernel {
    TempDir root{"weft_jit_root"};
    TempKernel() {
        write_text_file(root / "tmp_jit/kernel.cuh",
                        "#pragma once\n#include \"weft/common/device_ctx.hpp\"\n#include \"tweak.cuh\"\n"
                        "template <int K>\n__global__ void tmp_kernel(weft::DeviceCtx ctx, int* out) {\n"
                        "    out[threadIdx.x] = K + kTweak + ctx.rank;\n}\n");
        set_tweak(1);
    }
    void set_tweak(int v) {
        write_text_file(root / "tmp_jit/tweak.cuh", "#pragma once\nconstexpr int kTweak = " + std::to_string(v) + ";\n");
    }
    static KernelSpec spec() {
        KernelSpec s;
        s.header = "tmp_jit/kernel.cuh";
        s.instantiation = "tmp_kernel<3>";
        s.arch = kArch;
        return s;
    }
};

TEST(JitCompiler, ChangingAnIncludedHeaderMisses) {
    TempKernel k;
    TempDir cache("weft_jit_cache");
    Compiler compiler(isolated_compiler_config(cache.path(), {k.root.path()}));
    const CompileResult a = compiler.compile(TempKernel::spec());
    EXPECT_NE(std::find(a.headers.begin(), a.headers.end(), "tmp_jit/tweak.cuh"), a.headers.end())
        << "a quoted include next to the including header is found and hashed";
    EXPECT_EQ(compiler.compile(TempKernel::spec()).origin, CompileResult::Origin::kMemory);
    k.set_tweak(2);
    const CompileResult b = compiler.compile(TempKernel::spec());
    EXPECT_NE(a.key, b.key);
    EXPECT_EQ(b.origin, CompileResult::Origin::kCompiled);
    EXPECT_EQ(compiler.stats().compiles, 2u);
    EXPECT_EQ(compiler.stats().misses, 2u);
    k.set_tweak(1);  // back to the first content: the first entry is still on disk
    Compiler fresh(isolated_compiler_config(cache.path(), {k.root.path()}));
    const CompileResult c = fresh.compile(TempKernel::spec());
    EXPECT_EQ(c.key, a.key);
    EXPECT_EQ(c.origin, CompileResult::Origin::kDisk);
}

// A header edited while its kernel compiles (each version written whole, by a rename): the binary may be of either
// version, so it is cached under neither the key hashed before nor any other: back at the first content, a compile
// builds again instead of taking the entry the edited sources may have produced.
TEST(JitCompiler, AHeaderEditedDuringTheCompileLeavesNoCacheEntry) {
    TempKernel k;
    TempDir cache("weft_jit_cache");
    const auto set_whole = [&](int v) {
        write_text_file(k.root / "tmp_jit/tweak.tmp",
                        "#pragma once\nconstexpr int kTweak = " + std::to_string(v) + ";\n");
        fs::rename(k.root / "tmp_jit/tweak.tmp", k.root / "tmp_jit/tweak.cuh");
    };
    Compiler compiler(isolated_compiler_config(cache.path(), {k.root.path()}));
    const std::string first_key = compiler.cache_key(TempKernel::spec());
    std::atomic<bool> done{false};
    std::atomic<int> edits{0};
    std::thread editor([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // after the key is hashed (a few headers)
        for (int v = 2; !done.load(); ++v) {
            set_whole(v);
            ++edits;
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
    });
    CompileResult during;
    try {
        during = compiler.compile(TempKernel::spec());
    } catch (...) {
        done = true;
        editor.join();
        throw;
    }
    done = true;
    editor.join();
    if (during.key != first_key) GTEST_SKIP() << "the first edit came before the key was hashed: nothing to check";
    ASSERT_GT(edits.load(), 0);
    EXPECT_EQ(during.origin, CompileResult::Origin::kCompiled);
    set_whole(1);
    EXPECT_EQ(compiler.cache_key(TempKernel::spec()), first_key);
    EXPECT_EQ(compiler.compile(TempKernel::spec()).origin, CompileResult::Origin::kCompiled)
        << "the build of edited sources was kept in memory under the first content's key";
    Compiler fresh(isolated_compiler_config(cache.path(), {k.root.path()}));
    EXPECT_EQ(fresh.compile(TempKernel::spec()).origin, CompileResult::Origin::kDisk)
        << "the second build (of unchanged sources) is stored";
}

TEST(JitCompiler, ChangingAWeftHeaderMissesViaAShadowingRoot) {
    TempDir shadow("weft_jit_shadow");
    Compiler plain(isolated_compiler_config(fs::path()));
    const std::string base = plain.cache_key(saxpy(4));
    // An extra root is searched first: a copy of token.cuh there replaces weft's.
    const std::string token = read_text_file(plain.roots().weft_include / "weft/device/token.cuh");
    ASSERT_FALSE(token.empty());
    write_text_file(shadow / "weft/device/token.cuh", token);
    Compiler same(isolated_compiler_config(fs::path(), {shadow.path()}));
    EXPECT_EQ(same.cache_key(saxpy(4)), base) << "identical content, identical key";
    write_text_file(shadow / "weft/device/token.cuh", token + "\n// edited\n");
    Compiler edited(isolated_compiler_config(fs::path(), {shadow.path()}));
    EXPECT_NE(edited.cache_key(saxpy(4)), base);
    // ... and the edited header is the one NVRTC compiles.
    write_text_file(shadow / "weft/device/token.cuh", token + "\n#error shadow header used\n");
    Compiler broken(isolated_compiler_config(fs::path(), {shadow.path()}));
    try {
        broken.compile(saxpy(4));
        FAIL() << "the shadowing header was not used";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("shadow header used"), std::string::npos) << e.what();
    }
}

TEST(JitCompiler, KeyIsStableWhenTheTreeMoves) {
    Compiler here(isolated_compiler_config(fs::path()));
    TempDir moved("weft_jit_moved");
    fs::copy(here.roots().weft_include, moved / "include", fs::copy_options::recursive);
    fs::copy(here.roots().weft_kernels, moved / "kernels", fs::copy_options::recursive);
    auto roots = weft_roots_at(moved.path());
    ASSERT_TRUE(roots.has_value());
    roots->cuda = here.roots().cuda;
    CompilerConfig config = isolated_compiler_config(fs::path());
    config.roots = *roots;
    Compiler there(config);
    EXPECT_EQ(there.cache_key(saxpy(4)), here.cache_key(saxpy(4)))
        << "no absolute path may enter the key: a cache warmed in one tree must hit in another";
}

TEST(JitCompiler, KeyCoversTheToolkitHeadersButNotTheirPath) {
    Compiler here(isolated_compiler_config(fs::path()));
    ASSERT_FALSE(here.roots().cuda.empty());
    const fs::path toolkit = here.roots().cuda.front();
    const std::string cuda_h = read_text_file(toolkit / "cuda.h");
    ASSERT_NE(cuda_h.find("CUDA_VERSION"), std::string::npos);
    EXPECT_EQ(toolkit_headers_digest(here.roots().cuda), toolkit_headers_digest(here.roots().cuda));
    // Another folder holding the same version headers: the key is the same (it names no path) ...
    TempDir copy("weft_jit_toolkit");
    for (const char* name : {"cuda.h", "cuda_fp16.hpp", "cuda_bf16.hpp", "cuda_fp8.hpp"}) {
        if (fs::exists(toolkit / name)) write_text_file(copy / name, read_text_file(toolkit / name));
    }
    for (const fs::path& dir : here.roots().cuda) {
        const fs::path cccl = dir / "cuda/std/__cccl/version.h";
        if (fs::exists(cccl)) {
            write_text_file(copy / "cuda/std/__cccl/version.h", read_text_file(cccl));
            break;
        }
    }
    EXPECT_EQ(toolkit_headers_digest({copy.path()}), toolkit_headers_digest(here.roots().cuda));
    auto with_toolkit = [&](const fs::path& dir) {
        CompilerConfig config = isolated_compiler_config(fs::path());
        IncludeRoots roots = here.roots();
        roots.cuda = {dir};
        config.roots = roots;
        return Compiler(config).cache_key(saxpy(4));
    };
    const std::string base = here.cache_key(saxpy(4));
    EXPECT_EQ(with_toolkit(copy.path()), base);
    // ... and another toolkit's headers (here: cuda.h of another patch release) give another key.
    write_text_file(copy / "cuda.h", cuda_h + "\n/* another patch release */\n");
    EXPECT_NE(with_toolkit(copy.path()), base);
}

TEST(JitCompiler, ConcurrentProcessesCompileOnceAndLeaveOneValidEntry) {
    TempDir cache("weft_jit_cache");
    constexpr int kChildren = 4;
    int start[2], results[2];
    ASSERT_EQ(::pipe(start), 0);
    ASSERT_EQ(::pipe(results), 0);
    std::vector<pid_t> children;
    for (int i = 0; i < kChildren; ++i) {
        const pid_t pid = ::fork();
        ASSERT_GE(pid, 0);
        if (pid == 0) {
            ::alarm(120);  // a hung child dies instead of hanging the test
            ::close(start[1]);
            char go = 0;
            (void)!::read(start[0], &go, 1);  // returns at EOF: all children start together
            int record[3] = {-1, -1, 0};
            try {
                Compiler compiler(isolated_compiler_config(cache.path()));
                const CompileResult r = compiler.compile(saxpy(16, 3));
                record[0] = static_cast<int>(compiler.stats().compiles);
                record[1] = static_cast<int>(compiler.stats().disk_hits);
                const Digest d = sha256(r.cubin->data(), r.cubin->size());
                std::memcpy(&record[2], d.data(), sizeof(int));
            } catch (...) {
            }
            (void)!::write(results[1], record, sizeof(record));
            ::_exit(0);
        }
        children.push_back(pid);
    }
    ::close(start[0]);
    ::close(results[1]);
    ::close(start[1]);  // go
    int total_compiles = 0, total_hits = 0;
    std::vector<int> digests;
    for (int i = 0; i < kChildren; ++i) {
        int record[3];
        ASSERT_EQ(::read(results[0], record, sizeof(record)), static_cast<ssize_t>(sizeof(record)));
        ASSERT_GE(record[0], 0) << "a child failed to compile";
        total_compiles += record[0];
        total_hits += record[1];
        digests.push_back(record[2]);
    }
    ::close(results[0]);
    for (pid_t pid : children) {
        int status = 0;
        ASSERT_EQ(::waitpid(pid, &status, 0), pid);
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    EXPECT_EQ(total_compiles, 1) << "the key's lock lets exactly one process compile";
    EXPECT_EQ(total_hits, kChildren - 1);
    for (int d : digests) EXPECT_EQ(d, digests.front()) << "every process got the same cubin";
    // One entry, valid, and no temporary file left behind.
    int entries = 0;
    for (const auto& f : fs::directory_iterator(cache / "jit")) {
        const std::string name = f.path().filename().string();
        EXPECT_EQ(name.find(".tmp."), std::string::npos) << name;
        if (f.path().extension() == ".wjit") ++entries;
    }
    EXPECT_EQ(entries, 1);
    Compiler check(isolated_compiler_config(cache.path()));
    EXPECT_EQ(check.disk_status(saxpy(16, 3)), DiskCache::LoadStatus::kHit);
}

TEST(JitCompiler, ConcurrentThreadsCompileOnce) {
    TempDir cache("weft_jit_cache");
    // Threads sharing one Compiler, and threads with a Compiler each on one folder (the file lock
    // excludes them too).
    Compiler shared(isolated_compiler_config(cache.path()));
    std::vector<std::unique_ptr<Compiler>> own;
    for (int i = 0; i < 3; ++i) own.push_back(std::make_unique<Compiler>(isolated_compiler_config(cache.path())));
    std::atomic<int> ready{0};
    std::vector<std::string> keys(6);
    std::vector<std::thread> threads;
    for (int t = 0; t < 6; ++t) {
        threads.emplace_back([&, t] {
            ++ready;
            while (ready.load() < 6) std::this_thread::yield();
            Compiler& c = t < 3 ? shared : *own[static_cast<size_t>(t - 3)];
            keys[static_cast<size_t>(t)] = c.compile(saxpy(5, 2)).key;
        });
    }
    for (auto& th : threads) th.join();
    uint64_t compiles = shared.stats().compiles;
    for (auto& c : own) compiles += c->stats().compiles;
    EXPECT_EQ(compiles, 1u);
    for (const auto& k : keys) EXPECT_EQ(k, keys.front());
}

// Damages the entry for `spec` and checks that a fresh compiler detects it, rebuilds it, and leaves
// a valid entry behind.
void expect_rebuilt_after(const std::function<void(const fs::path&)>& damage, const char* what) {
    SCOPED_TRACE(what);
    TempDir cache("weft_jit_cache");
    std::vector<char> good;
    std::string key;
    {
        Compiler c(isolated_compiler_config(cache.path()));
        const CompileResult r = c.compile(saxpy(3));
        good = *r.cubin;
        key = r.key;
    }
    const fs::path entry = cache / ("jit/" + key + ".wjit");
    ASSERT_TRUE(fs::exists(entry));
    damage(entry);
    Compiler c(isolated_compiler_config(cache.path()));
    EXPECT_EQ(c.disk_status(saxpy(3)), DiskCache::LoadStatus::kCorrupt);
    const CompileResult r = c.compile(saxpy(3));
    EXPECT_EQ(r.origin, CompileResult::Origin::kCompiled);
    EXPECT_EQ(*r.cubin, good);
    EXPECT_EQ(c.stats().corrupt_entries, 1u);
    EXPECT_EQ(c.stats().compiles, 1u);
    EXPECT_EQ(c.disk_status(saxpy(3)), DiskCache::LoadStatus::kHit) << "the rebuilt entry replaced the bad one";
}

TEST(JitCompiler, CorruptEntriesAreRebuilt) {
    expect_rebuilt_after(
        [](const fs::path& p) {
            std::vector<char> bytes = read_file_bytes(p);
            bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x5a);  // inside the cubin
            write_file_atomically(p, bytes.data(), bytes.size());
        },
        "a flipped byte in the payload");
    expect_rebuilt_after(
        [](const fs::path& p) {
            std::vector<char> bytes = read_file_bytes(p);
            bytes.resize(bytes.size() - 100);
            write_file_atomically(p, bytes.data(), bytes.size());
        },
        "a truncated file");
    expect_rebuilt_after(
        [](const fs::path& p) {
            std::vector<char> bytes = read_file_bytes(p);
            bytes.resize(40);
            write_file_atomically(p, bytes.data(), bytes.size());
        },
        "a file shorter than its header");
    expect_rebuilt_after([](const fs::path& p) { write_text_file(p, ""); }, "an empty file");
}

TEST(JitCompiler, CompileErrorShowsTheLogTheSourceAndTheConfig) {
    TempDir cache("weft_jit_cache");
    TempDir dump("weft_jit_dump");
    Compiler compiler(isolated_compiler_config(cache.path()));
    KernelSpec bad = saxpy(0);  // fails the kernel's static_assert
    bad.description = "saxpy with zero items per thread";
    bad.options.dump_dir = dump.path().string();
    try {
        compiler.compile(bad);
        FAIL() << "an invalid config compiled";
    } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("items_per_thread must be in 1..16"), std::string::npos) << "NVRTC's log: " << what;
        EXPECT_NE(what.find("weft_jit_saxpy_"), std::string::npos) << "the generated source's name: " << what;
        EXPECT_NE(what.find("saxpy with zero items per thread"), std::string::npos) << "the config: " << what;
        EXPECT_NE(what.find(".items_per_thread = 0"), std::string::npos) << "the instantiation: " << what;
        EXPECT_NE(what.find("#include <jit_selftest/saxpy.cuh>"), std::string::npos) << "the source: " << what;
    }
    EXPECT_EQ(compiler.stats().failures, 1u);
    EXPECT_EQ(compiler.stats().compiles, 0u);
    // Nothing was cached, and the failing source was dumped for inspection.
    EXPECT_EQ(compiler.disk_status(bad), DiskCache::LoadStatus::kAbsent);
    bool dumped = false;
    for (const auto& f : fs::directory_iterator(dump.path())) dumped = dumped || f.path().extension() == ".cu";
    EXPECT_TRUE(dumped);

    KernelSpec syntax = saxpy(1);
    syntax.extra_code = "this is not C++;";
    try {
        compiler.compile(syntax);
        FAIL() << "a syntax error compiled";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("error"), std::string::npos) << e.what();
    }
}

// A header that includes a C++ standard library header fails under NVRTC (it has none): the error says what weft's
// JIT headers include instead.
TEST(JitCompiler, AMissingStandardHeaderGetsAHint) {
    TempDir root("weft_jit_std");
    Compiler compiler(isolated_compiler_config(fs::path(), {root.path()}));
    for (const std::string include : {"<cstdint>", "<type_traits>", "<stdint.h>"}) {
        SCOPED_TRACE(include);
        write_text_file(root / "uses_std.cuh", "#pragma once\n#include " + include + "\n__global__ void k() {}\n");
        KernelSpec spec{.header = "uses_std.cuh", .instantiation = "k", .arch = kArch};
        try {
            compiler.compile(spec);
            ADD_FAILURE() << "NVRTC found a standard library header";
        } catch (const Error& e) {
            const std::string what = e.what();
            EXPECT_NE(what.find("cannot open source file"), std::string::npos) << what;
            EXPECT_NE(what.find("weft/common/macros.hpp"), std::string::npos) << what;
            EXPECT_NE(what.find("docs/jit.md"), std::string::npos) << what;
        }
    }
    // A header of the user's own that is missing is not a standard one: no hint.
    write_text_file(root / "uses_own.cuh", "#pragma once\n#include \"my/missing.cuh\"\n__global__ void k() {}\n");
    try {
        compiler.compile({.header = "uses_own.cuh", .instantiation = "k", .arch = kArch});
        ADD_FAILURE() << "a missing header compiled";
    } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()).find("weft/common/macros.hpp"), std::string::npos) << e.what();
    }
}

TEST(JitCompiler, BadSpecsAreErrorsNamingTheArgument) {
    Compiler compiler(isolated_compiler_config(fs::path()));
    KernelSpec missing = saxpy(1);
    missing.header = "no_such_family/no_such_kernel.cuh";
    try {
        compiler.compile(missing);
        FAIL();
    } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("KernelSpec.header"), std::string::npos) << what;
        EXPECT_NE(what.find("no_such_family/no_such_kernel.cuh"), std::string::npos) << what;
    }
    KernelSpec empty = saxpy(1);
    empty.instantiation.clear();
    EXPECT_THROW(compiler.compile(empty), Error);
    KernelSpec wrong_arch = saxpy(1);
    wrong_arch.arch = "sm90a";
    EXPECT_THROW(compiler.compile(wrong_arch), Error);
    wrong_arch.arch = "sm_11";
    try {
        compiler.compile(wrong_arch);
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("not supported"), std::string::npos) << e.what();
    }
}

TEST(JitCompiler, ArchComesFromTheSpecTheEnvironmentOrTheDevice) {
    EXPECT_EQ(Compiler::resolve_arch("sm_90a"), "sm_90a");
    EXPECT_EQ(Compiler::resolve_arch("sm_100a"), "sm_100a");
    {
        ScopedEnv arch("WEFT_JIT_ARCH", "sm_90a");
        EXPECT_EQ(Compiler::resolve_arch(""), "sm_90a");
    }
    ScopedEnv no_arch("WEFT_JIT_ARCH", std::nullopt);
    if (!cuda_available()) {
        try {
            Compiler::resolve_arch("");
            FAIL();
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("WEFT_JIT_ARCH"), std::string::npos) << e.what();
        }
    } else {
        EXPECT_EQ(Compiler::resolve_arch("").rfind("sm_", 0), 0u);
    }
}

TEST(JitCompiler, MalformedArchIsAnErrorNamingIt) {
    EXPECT_EQ(Compiler::resolve_arch("sm_90"), "sm_90");
    EXPECT_EQ(Compiler::resolve_arch("sm_100f"), "sm_100f");
    for (const char* bad : {"sm_9", "sm_90x", "sm_90aa", "90a", "sm_1000a", "SM_90a", "sm_", "sm_a90", " sm_90a"}) {
        try {
            Compiler::resolve_arch(bad);
            ADD_FAILURE() << "'" << bad << "' was accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("arch must look like sm_90a"), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos) << e.what();
        }
    }
    // An arch from the environment is named as such: a user who never set KernelSpec::arch sees where it came from.
    const ScopedEnv env("WEFT_JIT_ARCH", "sm90a");
    try {
        Compiler::resolve_arch("");
        ADD_FAILURE() << "WEFT_JIT_ARCH=sm90a was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("WEFT_JIT_ARCH: arch must look like sm_90a"), std::string::npos)
            << e.what();
    }
}

TEST(JitCompiler, LtoGoesThroughNvJitLink) {
    Compiler compiler(isolated_compiler_config(fs::path()));
    KernelSpec spec = saxpy(4);
    spec.options.lto = true;
    const CompileResult r = compiler.compile(spec);
    expect_cuda_elf(*r.cubin);
    EXPECT_TRUE(contains(*r.cubin, r.lowered_name));
    EXPECT_NE(r.key, compiler.cache_key(saxpy(4)));
    EXPECT_GT(r.ptxas_info.registers, 0) << "nvJitLink -verbose reports ptxas' numbers: " << r.log;
}

// Writes a device library defining weft_test_scale(v) = 3v, as LTO-IR or as a relocatable cubin.
fs::path write_device_library(const fs::path& dir, bool lto) {
    const char* src = "extern \"C\" __device__ float weft_test_scale(float v) { return 3.0f * v; }\n";
    nvrtcProgram prog = nullptr;
    EXPECT_EQ(nvrtcCreateProgram(&prog, src, "scale.cu", 0, nullptr, nullptr), NVRTC_SUCCESS);
    std::vector<const char*> opts = {"-arch=sm_90a", "-rdc=true"};
    if (lto) opts.push_back("-dlto");
    EXPECT_EQ(nvrtcCompileProgram(prog, static_cast<int>(opts.size()), opts.data()), NVRTC_SUCCESS);
    size_t size = 0;
    std::vector<char> image;
    if (lto) {
        nvrtcGetLTOIRSize(prog, &size);
        image.resize(size);
        nvrtcGetLTOIR(prog, image.data());
    } else {
        nvrtcGetCUBINSize(prog, &size);
        image.resize(size);
        nvrtcGetCUBIN(prog, image.data());
    }
    nvrtcDestroyProgram(&prog);
    const fs::path path = dir / (lto ? "scale.ltoir" : "scale.cubin");
    write_file_atomically(path, image.data(), image.size());
    return path;
}

KernelSpec scaled_copy_spec(const fs::path& library, bool lto) {
    KernelSpec spec;
    spec.header = "weft/device/token.cuh";
    spec.extra_code =
        "extern \"C\" __device__ float weft_test_scale(float v);\n"
        "extern \"C\" __global__ void weft_test_scaled_copy(const float* x, float* y, int n) {\n"
        "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "    if (i < n) y[i] = weft_test_scale(x[i]);\n}\n";
    spec.instantiation = "weft_test_scaled_copy";
    spec.arch = kArch;
    spec.options.lto = lto;
    if (!library.empty()) spec.options.link_files = {library.string()};
    return spec;
}

TEST(JitCompiler, LinksDeviceLibrariesWithNvJitLink) {
    TempDir dir("weft_jit_lib");
    Compiler compiler(isolated_compiler_config(fs::path()));
    for (bool lto : {true, false}) {
        SCOPED_TRACE(lto ? "LTO-IR library" : "relocatable cubin library");
        const fs::path lib = write_device_library(dir.path(), lto);
        const CompileResult r = compiler.compile(scaled_copy_spec(lib, lto));
        expect_cuda_elf(*r.cubin);
        EXPECT_EQ(r.lowered_name, "weft_test_scaled_copy");
        EXPECT_TRUE(contains(*r.cubin, "weft_test_scaled_copy"));
        // The library's content is part of the key.
        const std::string key = r.key;
        std::vector<char> bytes = read_file_bytes(lib);
        bytes.push_back(0);
        write_file_atomically(dir / "other.bin", bytes.data(), bytes.size());
        KernelSpec other = scaled_copy_spec(dir / "other.bin", lto);
        EXPECT_NE(compiler.cache_key(other), key);
        // Without the library the link fails with nvJitLink's log.
        try {
            compiler.compile(scaled_copy_spec(fs::path(), lto));
            FAIL() << "an undefined device function linked";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("weft_test_scale"), std::string::npos) << e.what();
        }
    }
}

TEST(JitCompiler, DumpDirReceivesSourcePtxCubinAndLog) {
    TempDir dump("weft_jit_dump");
    Compiler compiler(isolated_compiler_config(fs::path()));
    KernelSpec spec = saxpy(2, 2);
    spec.options.dump_dir = dump.path().string();
    const CompileResult r = compiler.compile(spec);
    const fs::path base = dump / fs::path(r.source_name).stem().string();
    EXPECT_EQ(read_text_file(base.string() + ".cu"), r.source);
    EXPECT_NE(read_text_file(base.string() + ".ptx").find(".entry"), std::string::npos);
    const std::vector<char> cubin = read_file_bytes(base.string() + ".cubin");
    EXPECT_EQ(cubin, *r.cubin);
    EXPECT_NE(read_text_file(base.string() + ".log").find("Used"), std::string::npos);
}

TEST(JitCompiler, GeneratedSourceIncludesAndPlacesCode) {
    KernelSpec spec = saxpy(1);
    spec.preamble = "#define WEFT_PREAMBLE 1";
    spec.extra_code = "// after";
    const std::string src = Compiler::generate_source(spec);
    const size_t pre = src.find("#define WEFT_PREAMBLE 1");
    const size_t inc = src.find("#include <jit_selftest/saxpy.cuh>");
    const size_t post = src.find("// after");
    ASSERT_NE(pre, std::string::npos);
    ASSERT_NE(inc, std::string::npos);
    ASSERT_NE(post, std::string::npos);
    EXPECT_LT(pre, inc);
    EXPECT_LT(inc, post);
}

TEST(JitCompiler, EveryAotSpecCompiles) {
    Compiler compiler(isolated_compiler_config(fs::path()));
    const auto specs = aot_specs();
    ASSERT_GE(specs.size(), 3u);
    for (KernelSpec spec : specs) {
        spec.arch = kArch;
        EXPECT_NO_THROW(compiler.compile(spec)) << spec.describe();
    }
}

// jit::compiler(folder): one process-wide compiler per folder, searching it before weft's roots.
TEST(JitCompiler, ProcessWideCompilerForAFolder) {
    TempDir a("weft_jit_root_a"), b("weft_jit_root_b");
    write_text_file(a / "mine.cuh", "#pragma once\n__global__ void mine() {}\n");
    EXPECT_EQ(&compiler(fs::path()), &compiler());
    Compiler& ca = compiler(a.path());
    EXPECT_EQ(&compiler(a.path() / "."), &ca) << "the same folder, spelled otherwise";
    EXPECT_NE(&compiler(b.path()), &ca);
    EXPECT_NE(&ca, &compiler());
    ASSERT_FALSE(ca.roots().extra.empty());
    EXPECT_EQ(ca.roots().extra.back(), fs::weakly_canonical(a.path()));
    const KernelSpec spec{.header = "mine.cuh", .instantiation = "mine", .arch = kArch};
    EXPECT_EQ(ca.cache_key(spec).size(), 64u);  // found under the folder
    EXPECT_THROW(compiler(b.path()).cache_key(spec), Error);
    try {
        compiler(a / "mine.cuh");
        ADD_FAILURE() << "a file was taken for a folder";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("must be a directory"), std::string::npos) << e.what();
    }
}

// ---- include roots ----

TEST(JitPaths, FindsTheSourceTreeFromTheExecutable) {
    ScopedEnv home("WEFT_HOME", std::nullopt);
    const IncludeRoots roots = find_include_roots();
    EXPECT_TRUE(fs::exists(roots.weft_include / "weft/device/token.cuh"));
    EXPECT_TRUE(fs::exists(roots.weft_kernels / "jit_selftest/saxpy.cuh"));
    EXPECT_EQ(fs::canonical(roots.weft_include), fs::canonical(source_root() / "include"));
    EXPECT_NE(roots.found_by.find("searched upward"), std::string::npos) << roots.found_by;
}

// The headers the library and the kernels share are checked against the ones the library was built from: the source
// tree's pass; a copy with one struct changed (a stale install, another version's tree) is refused by name, as is a
// Compiler whose WEFT_HOME points there.
TEST(JitPaths, HeadersOtherThanTheLibrarysAreRefused) {
    ScopedEnv home("WEFT_HOME", std::nullopt);
    const IncludeRoots roots = find_include_roots();
    EXPECT_NO_THROW(check_headers_match_library(roots));
    TempDir tree("weft_stale_headers");
    fs::create_directories(tree / "include/weft");
    fs::copy(roots.weft_include / "weft", tree / "include/weft", fs::copy_options::recursive);
    fs::create_directories(tree / "kernels");
    IncludeRoots copy = roots;
    copy.weft_include = tree / "include";
    copy.found_by = "a test's copy";
    EXPECT_NO_THROW(check_headers_match_library(copy)) << "an identical copy";
    // A header of another name (an older install's, left by an install over it) is not looked at.
    write_text_file(tree / "include/weft/common/left_by_an_older_install.hpp", "#pragma once\n");
    EXPECT_NO_THROW(check_headers_match_library(copy)) << "a stray header";
    const fs::path header = tree / "include/weft/common/tp_params.hpp";
    write_text_file(header, read_text_file(header) + "\nstruct AFieldAddedLater { int x; };\n");
    try {
        check_headers_match_library(copy);
        ADD_FAILURE() << "a changed include/weft/common header was accepted";
    } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("are not the ones this library was built from"), std::string::npos) << what;
        EXPECT_NE(what.find(copy.weft_include.string()), std::string::npos) << what;
        EXPECT_NE(what.find("a test's copy"), std::string::npos) << what;
    }
    ScopedEnv stale("WEFT_HOME", tree.path().string());
    EXPECT_THROW(Compiler{isolated_compiler_config(fs::path())}, Error);
    // A header the library was built with, missing: named.
    fs::remove(header);
    try {
        check_headers_match_library(copy);
        ADD_FAILURE() << "a missing include/weft/common header was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("tp_params.hpp is missing"), std::string::npos) << e.what();
    }
}

TEST(JitPaths, WeftHomeOverridesAndIsValidated) {
    TempDir tree("weft_home");
    write_text_file(tree / "include/weft/device/token.cuh", "#pragma once\n");
    fs::create_directories(tree / "kernels");
    {
        ScopedEnv home("WEFT_HOME", tree.path().string());
        const IncludeRoots roots = find_include_roots();
        EXPECT_EQ(roots.weft_include, fs::canonical(tree / "include"));
        EXPECT_EQ(roots.weft_kernels, fs::canonical(tree / "kernels"));
        EXPECT_NE(roots.found_by.find("WEFT_HOME"), std::string::npos);
    }
    TempDir prefix("weft_prefix");  // an install layout
    write_text_file(prefix / "include/weft/device/token.cuh", "#pragma once\n");
    fs::create_directories(prefix / "share/weft/kernels");
    {
        ScopedEnv home("WEFT_HOME", prefix.path().string());
        EXPECT_EQ(find_include_roots().weft_kernels, fs::canonical(prefix / "share/weft/kernels"));
    }
    {
        ScopedEnv home("WEFT_HOME", (tree / "nowhere").string());
        try {
            find_include_roots();
            FAIL();
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("WEFT_HOME"), std::string::npos) << e.what();
        }
    }
    EXPECT_FALSE(weft_roots_at(tree / "include").has_value());
}

TEST(JitPaths, FindsTheToolkitHeaders) {
    {
        ScopedEnv a("CUDA_HOME", std::nullopt);
        ScopedEnv b("CUDA_PATH", std::nullopt);
        const auto dirs = find_cuda_include_dirs();
        ASSERT_FALSE(dirs.empty());
        EXPECT_TRUE(fs::exists(dirs.front() / "cuda_fp16.h"));
    }
    ScopedEnv bad("CUDA_HOME", "/nonexistent/cuda");
    try {
        find_cuda_include_dirs();
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("CUDA_HOME"), std::string::npos) << e.what();
    }
}

TEST(JitPaths, DefaultCacheDirFollowsTheEnvironment) {
    {
        ScopedEnv dir("WEFT_CACHE_DIR", "/some/cache");
        EXPECT_EQ(default_cache_dir(), fs::path("/some/cache"));
    }
    ScopedEnv no_dir("WEFT_CACHE_DIR", std::nullopt);
    {
        ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
        EXPECT_EQ(default_cache_dir(), fs::path("/xdg/weft"));
    }
    ScopedEnv no_xdg("XDG_CACHE_HOME", std::nullopt);
    ScopedEnv home("HOME", "/home/someone");
    EXPECT_EQ(default_cache_dir(), fs::path("/home/someone/.cache/weft"));
}

}  // namespace
}  // namespace weft::jit
