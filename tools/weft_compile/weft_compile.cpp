// SPDX-License-Identifier: MIT
// weft-compile: compiles kernel specialisations ahead of time into a JIT cache folder (no GPU needed).
#include <atomic>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "weft/jit/aot.hpp"
#include "weft/jit/cache.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/jit/paths.hpp"
#include "weft/ops/aot.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/progress.hpp"

namespace {

constexpr const char* kUsage = R"(usage: weft-compile [options]
Compiles kernel specialisations into a weft JIT cache folder, so that a later run (on a GPU machine)
loads them without compiling. Needs no GPU when --arch is given.

  --cache-dir DIR       cache folder to fill (default: WEFT_CACHE_DIR, else $XDG_CACHE_HOME/weft, else ~/.cache/weft)
  --arch ARCH           target, e.g. sm_90a (default: WEFT_JIT_ARCH, else the current GPU's)
  --specs FILE          compile the specs listed in FILE (repeatable); one per line:
                          header|instantiation
                        e.g. jit_selftest/saxpy.cuh|weft::kernels::jit_selftest::saxpy<...>
                        ('#' starts a comment line, a trailing '\' continues a line)
  --builtin             compile the specs weft registers for its own ops (see --list)
  --fused-gemm HEADER,SCHEDULER,HOOK
                        compile a weft::ops::FusedGemm of your own for every config of fused_gemm_candidates:
                        the kernels a FusedGemm with that header, scheduler and hook loads, its include_root
                        being the first --include-root (none: a header under weft's roots); split at the first
                        two commas (repeatable)
  --fused-gemm-dtypes IN,OUT
                        the candidates' input and output dtypes (default bf16,bf16)
  --list                print the selected specs and their cache keys, compile nothing
  --include-root DIR    extra include root searched before weft's (repeatable)
  --lineinfo            compile with -lineinfo      } these change the cache key: use the same
  --lto                 compile with LTO            } options (and WEFT_JIT_* variables) as the
  --maxrregcount N      limit registers per thread  } run that should hit the cache
  --define NAME[=VAL]   add -DNAME[=VAL] (repeatable)
  --expect-cached       compile nothing; exit 1 unless every spec is already in the cache
  --load                also load every kernel on the current GPU (proves the entries load)
  --strict              exit 1 when a kernel spills registers or ptxas warns about its speed (C75xx)
  --jobs N              compile N specs at a time (default 1; NVRTC runs one compile per thread)
  --prune DAYS          first remove the cache's entries not used for DAYS days (1..36500); alone, only that
  -h, --help            this text
Exit status: 0 on success, 1 when a spec failed (or is missing with --expect-cached, or is flagged by --strict),
2 on bad usage.
)";

int usage_error(const std::string& message) {
    std::fprintf(stderr, "weft-compile: %s\n%s", message.c_str(), kUsage);
    return 2;
}

// The whole of `text` as an integer in [lo, hi], else nullopt: "4x", "1e3", " 4", "+4" and "" are refused.
std::optional<int> parse_int_in(const std::string& text, int lo, int hi) {
    int v = 0;
    const char* end = text.data() + text.size();
    const auto [ptr, ec] = std::from_chars(text.data(), end, v);
    if (ec != std::errc{} || ptr != end || v < lo || v > hi) return std::nullopt;
    return v;
}

// "HEADER,SCHEDULER,HOOK", split at the first two commas (a hook's template arguments may hold more).
weft::ops::FusedGemmSpec parse_fused_gemm(const std::string& text) {
    const size_t a = text.find(',');
    const size_t b = a == std::string::npos ? a : text.find(',', a + 1);
    if (b == std::string::npos || a == 0 || b == a + 1 || b + 1 == text.size()) {
        throw weft::Error("--fused-gemm needs HEADER,SCHEDULER,HOOK, got '" + text + "'");
    }
    return {.header = text.substr(0, a),
            .scheduler = text.substr(a + 1, b - a - 1),
            .hook = text.substr(b + 1),
            .name = text.substr(0, a)};
}

// "IN,OUT": two dtype names (dtype_name: bf16, f16, f32 ...).
std::pair<weft::DType, weft::DType> parse_dtypes(const std::string& text) {
    const auto dtype = [&](const std::string& name) {
        for (int i = 0; i <= static_cast<int>(weft::DType::kU8); ++i) {
            if (name == weft::dtype_name(static_cast<weft::DType>(i))) return static_cast<weft::DType>(i);
        }
        throw weft::Error("--fused-gemm-dtypes: unknown dtype '" + name + "' in '" + text + "'");
    };
    const size_t comma = text.find(',');
    if (comma == std::string::npos) throw weft::Error("--fused-gemm-dtypes needs IN,OUT, got '" + text + "'");
    return {dtype(text.substr(0, comma)), dtype(text.substr(comma + 1))};
}

}  // namespace

int main(int argc, char** argv) {
    namespace fs = std::filesystem;
    namespace jit = weft::jit;
    namespace ops = weft::ops;
    std::optional<fs::path> cache_dir;
    std::string arch;
    std::vector<std::string> spec_files;
    std::vector<ops::FusedGemmSpec> fused;
    std::pair<weft::DType, weft::DType> fused_dtypes{weft::DType::kBF16, weft::DType::kBF16};
    bool builtin = false, list = false, expect_cached = false, load = false, strict = false;
    int jobs = 1;
    std::optional<int> prune_days;
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
            } else if (a == "--fused-gemm") {
                fused.push_back(parse_fused_gemm(value()));
            } else if (a == "--fused-gemm-dtypes") {
                fused_dtypes = parse_dtypes(value());
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
                const std::optional<int> n = parse_int_in(v, 1, 255);
                if (!n) return usage_error("--maxrregcount needs a number in 1..255, got '" + v + "'");
                options.max_registers = *n;
            } else if (a == "--define") {
                options.defines.push_back(value());
            } else if (a == "--expect-cached") {
                expect_cached = true;
            } else if (a == "--load") {
                load = true;
            } else if (a == "--strict") {
                strict = true;
            } else if (a == "--jobs") {
                const std::string v = value();
                const std::optional<int> n = parse_int_in(v, 1, 256);
                if (!n) return usage_error("--jobs needs a number in 1..256, got '" + v + "'");
                jobs = *n;
            } else if (a == "--prune") {
                const std::string v = value();
                prune_days = parse_int_in(v, 1, 36500);
                if (!prune_days) return usage_error("--prune needs a number of days in 1..36500, got '" + v + "'");
            } else {
                return usage_error("unknown option '" + a + "'");
            }
        }
    } catch (const weft::Error& e) {
        return usage_error(e.what());
    }
    if (!builtin && spec_files.empty() && fused.empty() && !prune_days) {
        return usage_error("nothing to compile: give --specs FILE, --fused-gemm or --builtin");
    }
    if (strict && (list || expect_cached)) {
        // --strict judges what a compile reports; --list and --expect-cached compile nothing.
        return usage_error(std::string("--strict checks what compiling reports: it does not combine with ") +
                           (list ? "--list" : "--expect-cached"));
    }

    try {
        config.cache_dir = cache_dir ? cache_dir : jit::default_cache_dir();
        if (!config.cache_dir) return usage_error("no cache folder: give --cache-dir (or set WEFT_CACHE_DIR)");
        if (prune_days) {
            const jit::DiskCache cache(*config.cache_dir);
            const jit::DiskCache::PruneResult r = cache.prune(std::chrono::hours(24) * *prune_days);
            std::printf(
                "weft-compile: pruned %s: removed %llu entries unused for %d days (%.1f MiB) and %llu lock "
                "files, kept %llu\n",
                config.cache_dir->string().c_str(), static_cast<unsigned long long>(r.removed), *prune_days,
                static_cast<double>(r.removed_bytes) / (1 << 20), static_cast<unsigned long long>(r.removed_locks),
                static_cast<unsigned long long>(r.kept));
            if (!builtin && spec_files.empty() && fused.empty()) return 0;
        }
        std::vector<jit::KernelSpec> specs;
        if (builtin) {
            ops::register_op_aot_specs();
            specs = jit::aot_specs();
        }
        for (const auto& file : spec_files) {
            const std::vector<char> bytes = jit::read_file_bytes(file);
            for (auto& s : jit::parse_spec_file(std::string(bytes.begin(), bytes.end()), file)) specs.push_back(std::move(s));
        }
        for (ops::FusedGemmSpec& f : fused) {
            // As FusedGemm's: a header under an extra root gets weft's GEMM kernel included after it.
            if (!config.extra_include_roots.empty()) f.include_root = config.extra_include_roots.front();
            const std::vector<weft::GemmConfig> configs =
                ops::fused_gemm_candidates(fused_dtypes.first, fused_dtypes.second);
            if (configs.empty()) {
                return usage_error(std::string("--fused-gemm: no fused GEMM candidates for ") +
                                   weft::dtype_name(fused_dtypes.first) + " -> " +
                                   weft::dtype_name(fused_dtypes.second));
            }
            for (const weft::GemmConfig& c : configs) specs.push_back(ops::fused_gemm_kernel_spec(f, c));
        }
        const std::string target = jit::Compiler::resolve_arch(arch);
        for (auto& s : specs) {
            s.arch = target;
            s.options.lineinfo = s.options.lineinfo || options.lineinfo;
            s.options.lto = s.options.lto || options.lto;
            if (options.max_registers > 0) s.options.max_registers = options.max_registers;
            s.options.defines.insert(s.options.defines.end(), options.defines.begin(), options.defines.end());
        }

        // This tool reports every spec itself: the JIT's own progress lines would repeat them.
        if (!weft::env::get("WEFT_LOG")) {
            weft::LogLevels levels = weft::default_log_levels();
            levels.level[static_cast<size_t>(weft::LogSubsystem::kJit)] = weft::LogLevel::kWarn;
            weft::set_log_levels(levels);
        }
        jit::Compiler compiler(config);
        std::printf("weft-compile: %zu spec(s) for %s into %s\n", specs.size(), target.c_str(),
                    config.cache_dir->string().c_str());
        std::atomic<int> failed{0}, missing{0}, flagged{0};
        std::mutex print_mutex;
        // On stderr: a bar redrawn in place on a terminal, else a line at every tenth of the specs (and every 10 s).
        std::optional<weft::ProgressReporter> progress;
        if (!list && !expect_cached && !specs.empty()) progress.emplace("weft-compile", specs.size());
        // One spec on `c`: prints one line; compile errors count as failures, never stop the others.
        const auto process = [&](jit::Compiler& c, const jit::KernelSpec& spec) {
            try {
                if (list || expect_cached) {
                    const std::string key = c.cache_key(spec);
                    const auto status = c.disk_status(spec);
                    const char* state = status == jit::DiskCache::LoadStatus::kHit      ? "cached "
                                        : status == jit::DiskCache::LoadStatus::kAbsent ? "missing"
                                                                                        : "corrupt";
                    if (status != jit::DiskCache::LoadStatus::kHit) ++missing;
                    std::lock_guard<std::mutex> lock(print_mutex);
                    std::printf("  %s %s  %s\n", state, key.substr(0, 16).c_str(), spec.describe().c_str());
                    return;
                }
                const jit::CompileResult r = c.compile(spec);
                const char* state = r.origin == jit::CompileResult::Origin::kCompiled ? "compiled" : "cached  ";
                std::lock_guard<std::mutex> lock(print_mutex);
                if (progress) progress->clear();
                std::printf("  %s %s  %s  (%d registers, spills %d/%d bytes)\n", state, r.key.substr(0, 16).c_str(),
                            spec.describe().c_str(), r.ptxas_info.registers, r.ptxas_info.spill_store_bytes,
                            r.ptxas_info.spill_load_bytes);
                if (strict && (r.ptxas_info.spill_store_bytes != 0 || r.ptxas_info.spill_load_bytes != 0 ||
                               r.log.find("C75") != std::string::npos)) {
                    ++flagged;
                    std::fprintf(stderr, "weft-compile: --strict: %s spills registers or has a ptxas warning:\n%s\n",
                                 spec.describe().c_str(), r.log.c_str());
                }
                std::fflush(stdout);
                if (progress) progress->advance(spec.describe());
            } catch (const weft::Error& e) {
                ++failed;
                std::lock_guard<std::mutex> lock(print_mutex);
                if (progress) progress->clear();
                std::fprintf(stderr, "weft-compile: FAILED %s\n%s\n", spec.describe().c_str(), e.what());
                if (progress) progress->advance(spec.describe());
            }
        };
        jit::CompilerStats st{};
        const size_t workers = list || expect_cached ? 1 : std::min<size_t>(static_cast<size_t>(jobs), specs.size());
        if (workers <= 1) {
            for (const auto& spec : specs) process(compiler, spec);
        } else {
            // Each worker has its own Compiler (the disk cache is shared safely: entries are written to a
            // temporary file and renamed); specs are taken in order from one counter.
            std::atomic<size_t> next{0};
            std::vector<jit::CompilerStats> worker_stats(workers);
            std::vector<std::thread> threads;
            for (size_t w = 0; w < workers; ++w) {
                threads.emplace_back([&, w] {
                    jit::Compiler c(config);
                    for (size_t i = next++; i < specs.size(); i = next++) process(c, specs[i]);
                    worker_stats[w] = c.stats();
                });
            }
            for (auto& t : threads) t.join();
            for (const auto& ws : worker_stats) {
                st.memory_hits += ws.memory_hits;
                st.disk_hits += ws.disk_hits;
                st.compiles += ws.compiles;
            }
        }
        if (progress) progress->finish();
        // Loading needs the current context: done here, in this thread, once everything is compiled.
        if (load && !list && failed == 0) {
            for (const auto& spec : specs) {
                if (expect_cached && compiler.disk_status(spec) != jit::DiskCache::LoadStatus::kHit) continue;
                compiler.get_kernel(spec);
            }
        }
        const jit::CompilerStats main_stats = compiler.stats();
        st.memory_hits += main_stats.memory_hits;
        st.disk_hits += main_stats.disk_hits;
        st.compiles += main_stats.compiles;
        const std::string not_cached =
            (list || expect_cached) ? ", " + std::to_string(missing.load()) + " not cached" : "";
        const std::string not_clean = strict ? ", " + std::to_string(flagged.load()) + " spilling or warned" : "";
        std::printf("weft-compile: %zu spec(s): %llu compiled, %llu cache hit(s), %d failed%s%s, %llu loaded\n",
                    specs.size(), static_cast<unsigned long long>(st.compiles),
                    static_cast<unsigned long long>(st.hits()), failed.load(), not_cached.c_str(), not_clean.c_str(),
                    static_cast<unsigned long long>(main_stats.loads));
        if (failed > 0 || flagged > 0 || (expect_cached && missing > 0)) return 1;
        if (!list && !expect_cached) {
            // Filling the cache is the tool's whole job: a compile whose entry could not be stored (a folder that is
            // not writable or not trusted; the compiler only warns) fails it.
            int unstored = 0;
            for (const auto& spec : specs) {
                if (compiler.disk_status(spec) != jit::DiskCache::LoadStatus::kHit) ++unstored;
            }
            if (unstored > 0) {
                std::fprintf(stderr,
                             "weft-compile: %d of %zu spec(s) are not in %s after compiling (see the warnings "
                             "above: a folder this user cannot write, or one that others may write)\n",
                             unstored, specs.size(), config.cache_dir->string().c_str());
                return 1;
            }
        }
        return 0;
    } catch (const weft::Error& e) {
        std::fprintf(stderr, "weft-compile: %s\n", e.what());
        return 1;
    }
}
