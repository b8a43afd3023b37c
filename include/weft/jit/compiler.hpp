// SPDX-License-Identifier: MIT
// The JIT compiler: kernel template + config -> generated translation unit -> NVRTC (+ nvJitLink)
// -> cubin, cached on disk and in memory, loaded through the driver API.
//
//     weft::jit::KernelSpec spec;
//     spec.header = "jit_selftest/saxpy.cuh";
//     spec.instantiation = "weft::kernels::jit_selftest::saxpy<"
//                          "weft::kernels::jit_selftest::SaxpyConfig{.items_per_thread = 4}>";
//     weft::jit::Kernel& k = weft::jit::compiler().get_kernel(spec);
//     k.launch({.grid = {256}, .block = {256}, .stream = s}, ctx, 2.0f, x, y, n);
//
// Pipeline, caching and every knob: docs/jit.md.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "weft/jit/cache.hpp"
#include "weft/jit/kernel.hpp"
#include "weft/jit/options.hpp"
#include "weft/jit/paths.hpp"

namespace weft::jit {

/// One specialisation of one kernel template.
struct KernelSpec {
    std::string header{};         ///< included by the generated source, relative to an include root,
                                  ///< e.g. "gemm/gemm_sm90.cuh" (kernels/) or "weft/..." (include/)
    std::string instantiation{};  ///< a __global__ function, e.g. "ns::kernel<ns::Config{.tile_m = 128}>"
    std::string preamble{};       ///< code placed before the #include (macros, forward declarations)
    std::string extra_code{};     ///< code placed after the #include (helpers, a wrapper kernel)
    std::string description{};    ///< human-readable config for logs and errors; default: instantiation
    std::string arch{};           ///< "sm_90a" ...; empty: WEFT_JIT_ARCH, else the current device's
    CompileOptions options{};

    const std::string& describe() const { return description.empty() ? instantiation : description; }
};

/// ptxas' report, parsed from the log for REPORTING only (loading never depends on it). -1: absent.
struct PtxasInfo {
    int registers = -1;
    int spill_store_bytes = -1;
    int spill_load_bytes = -1;
    int stack_frame_bytes = -1;
    int static_smem_bytes = -1;
    std::string text;  ///< the lines of the log that concern the kernel
};

/// Parses ptxas' verbose report for `lowered_name` (or the first function when empty).
PtxasInfo parse_ptxas_info(const std::string& log, const std::string& lowered_name);

/// The compiled form of one spec.
struct CompileResult {
    enum class Origin { kMemory, kDisk, kCompiled };
    Origin origin = Origin::kCompiled;
    std::string key;                ///< 64 hex digits
    std::string arch;
    std::string source_name;        ///< name of the generated translation unit
    std::string source;             ///< the generated translation unit
    std::string lowered_name;
    std::shared_ptr<const std::vector<char>> cubin;
    std::string ptx;                ///< only when compiled by this call without LTO
    std::string log;                ///< NVRTC and nvJitLink output, incl. ptxas' report
    PtxasInfo ptxas_info;
    std::vector<std::string> headers;  ///< weft headers hashed into the key (include names)
};

/// Counters since the Compiler was made. hits() + misses == compile() requests, plus the get_kernel() calls served
/// from the in-process layer (memory_hits).
struct CompilerStats {
    uint64_t memory_hits = 0;   ///< served from the in-process layer (no file IO beyond header hashing)
    uint64_t disk_hits = 0;     ///< served from the disk cache (incl. entries another process wrote
                                ///< while this one waited on the key's lock)
    uint64_t misses = 0;        ///< needed compiling
    uint64_t compiles = 0;      ///< successful NVRTC (+ nvJitLink) runs
    uint64_t failures = 0;      ///< compile errors
    uint64_t corrupt_entries = 0;  ///< damaged disk entries found, deleted and rebuilt
    uint64_t loads = 0;         ///< libraries loaded into the driver
    uint64_t hits() const { return memory_hits + disk_hits; }
};

/// How a Compiler is set up. `from_env()` reads WEFT_CACHE_DIR, WEFT_JIT_DISABLE_CACHE, WEFT_HOME.
struct CompilerConfig {
    std::optional<std::filesystem::path> cache_dir;  ///< nullopt: no disk cache
    std::vector<std::filesystem::path> extra_include_roots;  ///< searched before weft's roots
    std::optional<IncludeRoots> roots;  ///< nullopt: find_include_roots() + find_cuda_include_dirs(), and the
                                        ///< Compiler's constructor throws when the found include/weft/common is
                                        ///< not the library's own (check_headers_match_library)
    bool apply_env_options = true;      ///< apply WEFT_JIT_* on top of each spec's options
    std::chrono::milliseconds lock_timeout{std::chrono::minutes(10)};  ///< wait on another compile

    static CompilerConfig from_env();
};

/// Compiles, caches and loads kernel specialisations. Thread-safe: ranks that are threads share one.
class Compiler {
public:
    explicit Compiler(CompilerConfig config = CompilerConfig::from_env());
    ~Compiler();
    Compiler(const Compiler&) = delete;
    Compiler& operator=(const Compiler&) = delete;

    /// The cubin for `spec`: from memory, else from disk, else compiled (and stored, unless a source changed while
    /// it compiled: then kept nowhere, with a warning). Needs no GPU
    /// when spec.arch (or WEFT_JIT_ARCH) is set. Compile errors throw weft::Error with the NVRTC log,
    /// the generated source's name and the spec's description.
    CompileResult compile(const KernelSpec& spec);

    /// compile() + load, memoised per spec: the second call for the same spec does no file IO. The
    /// kernel is loaded into the calling thread's current context before this returns.
    Kernel& get_kernel(const KernelSpec& spec);

    /// The cache key of `spec` (hashes its headers; compiles nothing).
    std::string cache_key(const KernelSpec& spec) const;
    /// Whether the disk cache holds a valid entry for `spec` (compiles and loads nothing; kAbsent when
    /// the disk cache is off).
    DiskCache::LoadStatus disk_status(const KernelSpec& spec) const;
    /// Whether compile(spec) would find `spec` compiled (in memory or a valid disk entry): nothing to wait for.
    bool is_cached(const KernelSpec& spec) const;
    /// Compiles every spec not yet cached, in order, with progress at notice level when there is any (on rank 0, or
    /// without a rank; the other ranks log it at info): "compiling 3 of 12 kernels for `what` (first use; cached
    /// afterwards)", one line per kernel, then the total time. A later get_kernel() of these specs finds them in
    /// memory. Returns how many specs were not cached. Throws as compile() on the first spec that fails.
    size_t warm(const std::vector<KernelSpec>& specs, const std::string& what);
    /// The generated translation unit for `spec`.
    static std::string generate_source(const KernelSpec& spec);
    /// `arch` validated ("sm_90a" ...), or the default when empty (WEFT_JIT_ARCH, else the current
    /// device: sm_90a for compute capability 9.0). Throws weft::Error when neither is available.
    static std::string resolve_arch(const std::string& arch);
    /// 16 hex digits that change with how kernels are compiled now: the toolchain (NVRTC's and nvJitLink's versions
    /// and files) and the options WEFT_JIT_* and WEFT_TRACE add to every spec (read at each call, as compiles read
    /// them). Autotune decisions carry it, so a decision tuned on traced or otherwise differently compiled kernels is
    /// not reused for other ones.
    static std::string code_fingerprint();

    CompilerStats stats() const;
    const IncludeRoots& roots() const { return roots_; }
    std::optional<std::filesystem::path> cache_dir() const;

private:
    struct Prepared;
    Prepared prepare(const KernelSpec& spec) const;
    void dump(const Prepared& p, const CompileResult& r) const;

    CompilerConfig config_;
    IncludeRoots roots_;
    std::string toolkit_digest_;  // toolkit_headers_digest(roots_.cuda), part of every key
    std::unique_ptr<DiskCache> disk_;
    /// A store into disk_ failed (a full disk, a folder turned read-only): later compiles neither take the entry's
    /// lock (each waiter would compile in turn, holding it) nor try to store.
    std::atomic<bool> disk_store_failed_{false};

    mutable std::mutex mutex_;
    std::map<std::string, std::shared_ptr<const CacheEntry>> memory_;       // key -> entry
    std::map<std::string, std::shared_ptr<std::mutex>> key_mutexes_;        // key -> in-process lock
    std::map<std::string, std::unique_ptr<Kernel>> kernels_;                // key -> loaded kernel
    std::map<std::string, Kernel*> spec_memo_;                              // spec fingerprint -> kernel

    struct AtomicStats {
        std::atomic<uint64_t> memory_hits{0}, disk_hits{0}, misses{0}, compiles{0}, failures{0},
            corrupt_entries{0}, loads{0};
    };
    mutable AtomicStats stats_;
};

/// The process-wide compiler (built from the environment on first use; never destroyed, so that
/// kernels stay valid until the process ends).
Compiler& compiler();

/// The process-wide compiler that also searches `extra_root` (a folder of your own kernel headers, searched before
/// weft's roots): built from the environment (CompilerConfig::from_env) on the first call for that folder, then the
/// same one for every call naming it (compared after weakly_canonical); never destroyed, as compiler()'s. An empty
/// path gives compiler(). Thread-safe. Throws weft::Error when `extra_root` is not a directory.
Compiler& compiler(const std::filesystem::path& extra_root);

/// Shorthand for compiler().get_kernel() with a spec of just a header and an instantiation.
Kernel& get_kernel(const std::string& header, const std::string& instantiation);

}  // namespace weft::jit
