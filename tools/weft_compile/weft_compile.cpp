// SPDX-License-Identifier: MIT
// weft-compile: compiles kernel specialisations ahead of time into a JIT cache folder (no GPU needed).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "weft/jit/aot.hpp"
#include "weft/jit/cache.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/jit/paths.hpp"
#include "weft/ops/aot.hpp"
#include "weft/runtime/error.hpp"

namespace {

constexpr const char* kUsage = R"(usage: weft-compile [options]
Compiles kernel specialisations into a weft JIT cache folder, so that a later run (on a GPU machine)
loads them without compiling. Needs no GPU when --arch is given.

  --cache-dir DIR       cache folder to fill (default: WEFT_CACHE_DIR, else ~/.cache/weft)
  --arch ARCH           target, e.g. sm_90a (default: WEFT_JIT_ARCH, else the current GPU's)
  --specs FILE          compile the specs listed in FILE (repeatable); one per line:
                          header|instantiation
                        e.g. jit_selftest/saxpy.cuh|weft::kernels::jit_selftest::saxpy<...>
                        ('#' starts a comment line, a trailing '\' continues a line)
  --builtin             compile the specs weft registers for its own ops (see --list)
  --list                print the selected specs and their cache keys, compile nothing
  --include-root DIR    extra include root searched before weft's (repeatable)
  --lineinfo            compile with -lineinfo      } these change the cache key: use the same
  --lto                 compile with LTO            } options (and WEFT_JIT_* variables) as the
  --maxrregcount N      limit registers per thread  } run that should hit the cache
  --define NAME[=VAL]   add -DNAME[=VAL] (repeatable)
  --expect-cached       compile nothing; exit 1 unless every spec is already in the cache
  --load                also load every kernel on the current GPU (proves the entries load)
  -h, --help            this text
Exit status: 0 on success, 1 when a spec failed (or is missing with --expect-cached), 2 on bad usage.
)";

int usage_error(const std::string& message) {
    std::fprintf(stderr, "weft-compile: %s\n%s", message.c_str(), kUsage);
    return 2;
}

}  // namespace

int main(int argc, char** argv) {
    namespace fs = std::filesystem;
    namespace jit = weft::jit;
    namespace ops = weft::ops;
    std::optional<fs::path> cache_dir;
    std::string arch;
    std::vector<std::string> spec_files;
    bool builtin = false, list = false, expect_cached = false, load = false;
    jit::CompilerConfig config;
    jit::CompileOptions options;
    try {
        for (int i = 1; i < argc; ++i) {
            const std::string a = argv[i];
            auto value = [&]() -> std::string {
                if (i + 1 >= argc) throw weft::Error(a + " needs a value");
                return argv[++i];
            };
            if (a == "-h" || a == "--help") {
                std::fputs(kUsage, stdout);
                return 0;
            } else if (a == "--cache-dir") {
                cache_dir = value();
            } else if (a == "--arch") {
                arch = value();
            } else if (a == "--specs") {
                spec_files.push_back(value());
            } else if (a == "--builtin") {
                builtin = true;
            } else if (a == "--list") {
                list = true;
            } else if (a == "--include-root") {
                config.extra_include_roots.push_back(value());
            } else if (a == "--lineinfo") {
                options.lineinfo = true;
            } else if (a == "--lto") {
                options.lto = true;
            } else if (a == "--maxrregcount") {
                const std::string v = value();
                options.max_registers = std::atoi(v.c_str());
                if (options.max_registers <= 0 || options.max_registers > 255) {
                    return usage_error("--maxrregcount needs a number in 1..255, got '" + v + "'");
                }
            } else if (a == "--define") {
                options.defines.push_back(value());
            } else if (a == "--expect-cached") {
                expect_cached = true;
            } else if (a == "--load") {
                load = true;
            } else {
                return usage_error("unknown option '" + a + "'");
            }
        }
    } catch (const weft::Error& e) {
        return usage_error(e.what());
    }
    if (!builtin && spec_files.empty()) return usage_error("nothing to compile: give --specs FILE and/or --builtin");

    try {
        config.cache_dir = cache_dir ? cache_dir : jit::default_cache_dir();
        if (!config.cache_dir) return usage_error("no cache folder: give --cache-dir (or set WEFT_CACHE_DIR)");
        std::vector<jit::KernelSpec> specs;
        if (builtin) {
            ops::register_op_aot_specs();
            specs = jit::aot_specs();
        }
        for (const auto& file : spec_files) {
            const std::vector<char> bytes = jit::read_file_bytes(file);
            for (auto& s : jit::parse_spec_file(std::string(bytes.begin(), bytes.end()), file)) specs.push_back(std::move(s));
        }
        const std::string target = jit::Compiler::resolve_arch(arch);
        for (auto& s : specs) {
            s.arch = target;
            s.options.lineinfo = s.options.lineinfo || options.lineinfo;
            s.options.lto = s.options.lto || options.lto;
            if (options.max_registers > 0) s.options.max_registers = options.max_registers;
            s.options.defines.insert(s.options.defines.end(), options.defines.begin(), options.defines.end());
        }

        jit::Compiler compiler(config);
        std::printf("weft-compile: %zu spec(s) for %s into %s\n", specs.size(), target.c_str(),
                    config.cache_dir->string().c_str());
        int failed = 0, missing = 0;
        for (const auto& spec : specs) {
            try {
                if (list || expect_cached) {
                    const std::string key = compiler.cache_key(spec);
                    const auto status = compiler.disk_status(spec);
                    const char* state = status == jit::DiskCache::LoadStatus::kHit      ? "cached "
                                        : status == jit::DiskCache::LoadStatus::kAbsent ? "missing"
                                                                                        : "corrupt";
                    if (status != jit::DiskCache::LoadStatus::kHit) ++missing;
                    std::printf("  %s %s  %s\n", state, key.substr(0, 16).c_str(), spec.describe().c_str());
                    if (load && !list && status == jit::DiskCache::LoadStatus::kHit) compiler.get_kernel(spec);
                    continue;
                }
                const jit::CompileResult r = compiler.compile(spec);
                const char* state = r.origin == jit::CompileResult::Origin::kCompiled ? "compiled" : "cached  ";
                std::printf("  %s %s  %s  (%d registers, spills %d/%d bytes)\n", state, r.key.substr(0, 16).c_str(),
                            spec.describe().c_str(), r.ptxas_info.registers, r.ptxas_info.spill_store_bytes,
                            r.ptxas_info.spill_load_bytes);
                if (load) compiler.get_kernel(spec);
            } catch (const weft::Error& e) {
                ++failed;
                std::fprintf(stderr, "weft-compile: FAILED %s\n%s\n", spec.describe().c_str(), e.what());
            }
        }
        const jit::CompilerStats st = compiler.stats();
        const std::string not_cached = (list || expect_cached) ? ", " + std::to_string(missing) + " not cached" : "";
        std::printf("weft-compile: %zu spec(s): %llu compiled, %llu cache hit(s), %d failed%s, %llu loaded\n",
                    specs.size(), static_cast<unsigned long long>(st.compiles),
                    static_cast<unsigned long long>(st.hits()), failed, not_cached.c_str(),
                    static_cast<unsigned long long>(st.loads));
        if (failed > 0 || (expect_cached && missing > 0)) return 1;
        return 0;
    } catch (const weft::Error& e) {
        std::fprintf(stderr, "weft-compile: %s\n", e.what());
        return 1;
    }
}
