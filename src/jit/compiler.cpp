// SPDX-License-Identifier: MIT
// The JIT compiler: source generation, dependency hashing, NVRTC + nvJitLink, the two cache layers.
#include "weft/jit/compiler.hpp"

#include <dlfcn.h>
#include <nvJitLink.h>
#include <nvrtc.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>

#include "weft/runtime/driver.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/progress.hpp"

namespace weft::jit {

namespace fs = std::filesystem;

namespace {

std::string nvrtc_version_text() {
    int major = 0, minor = 0;
    nvrtcVersion(&major, &minor);
    return std::to_string(major) + "." + std::to_string(minor);
}

std::string nvjitlink_version_text() {
    unsigned major = 0, minor = 0;
    if (nvJitLinkVersion(&major, &minor) != NVJITLINK_SUCCESS) return "unknown";
    return std::to_string(major) + "." + std::to_string(minor);
}

// The loaded library that defines `symbol`, through its links (its file name carries the full version, as in
// libnvrtc.so.13.0.88), and its size: the key's major.minor does not tell a patch release of the compiler apart.
std::string loaded_library_text(const void* symbol) {
    Dl_info info{};
    if (dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) return "unknown library";
    std::error_code ec;
    const fs::path path = fs::canonical(info.dli_fname, ec);
    if (ec) return info.dli_fname;
    const uintmax_t size = fs::file_size(path, ec);
    return path.filename().string() + ":" + (ec ? std::string("?") : std::to_string(size));
}

// NVRTC's and nvJitLink's versions and loaded files, for the cache key (computed once).
const std::string& toolchain_libraries_text() {
    static const std::string text =
        nvrtc_version_text() + " " + loaded_library_text(reinterpret_cast<const void*>(&nvrtcVersion)) + " " +
        nvjitlink_version_text() + " " + loaded_library_text(reinterpret_cast<const void*>(&nvJitLinkVersion));
    return text;
}

std::string one_line(const std::string& text) {
    std::string out = text;
    std::replace(out.begin(), out.end(), '\n', ' ');
    std::replace(out.begin(), out.end(), '\r', ' ');
    return out;
}

// ---- dependency scan: every weft header the generated source includes, transitively ----

struct Include {
    std::string name;
    bool quoted;
};

std::vector<Include> find_includes(const std::string& text) {
    std::vector<Include> out;
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
        size_t i = line.find_first_not_of(" \t");
        if (i == std::string::npos || line[i] != '#') continue;
        i = line.find_first_not_of(" \t", i + 1);
        if (i == std::string::npos || line.compare(i, 7, "include") != 0) continue;
        i = line.find_first_not_of(" \t", i + 7);
        if (i == std::string::npos || (line[i] != '"' && line[i] != '<')) continue;  // macro includes: skipped
        const char close = line[i] == '"' ? '"' : '>';
        const size_t end = line.find(close, i + 1);
        if (end == std::string::npos) continue;
        out.push_back({line.substr(i + 1, end - i - 1), close == '"'});
    }
    return out;
}

struct HeaderDigest {
    std::string name;    // include name relative to its root: stable when the tree moves
    std::string digest;  // hex SHA-256 of the content
};

class DependencyScanner {
public:
    explicit DependencyScanner(const std::vector<fs::path>& roots) : roots_(roots) {}

    // `dir`/`logical_dir`: the including file's folder on disk and relative to its root (empty for
    // the generated source, whose quoted includes resolve against the roots only).
    void scan(const std::string& text, const fs::path& dir, const fs::path& logical_dir) {
        for (const Include& inc : find_includes(text)) {
            fs::path found, logical;
            if (inc.quoted && !dir.empty()) {
                std::error_code ec;
                if (fs::is_regular_file(dir / inc.name, ec)) {
                    found = dir / inc.name;
                    logical = (logical_dir / inc.name).lexically_normal();
                }
            }
            if (found.empty()) {
                for (const fs::path& root : roots_) {
                    std::error_code ec;
                    if (fs::is_regular_file(root / inc.name, ec)) {
                        found = root / inc.name;
                        logical = fs::path(inc.name).lexically_normal();
                        break;
                    }
                }
            }
            // Not under a weft root: a toolkit header, covered by the toolkit version in the key.
            if (found.empty()) continue;
            std::error_code ec;
            const fs::path canon = fs::weakly_canonical(found, ec);
            if (!seen_.insert(ec ? found.string() : canon.string()).second) continue;
            const std::vector<char> bytes = read_file_bytes(found);
            const std::string content(bytes.begin(), bytes.end());
            headers_.push_back({logical.generic_string(), to_hex(sha256(content))});
            scan(content, found.parent_path(), logical.parent_path());
        }
    }

    std::vector<HeaderDigest> sorted() const {
        std::vector<HeaderDigest> out = headers_;
        std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
        return out;
    }

private:
    const std::vector<fs::path>& roots_;
    std::set<std::string> seen_;
    std::vector<HeaderDigest> headers_;
};

std::string sanitize(const std::string& text) {
    std::string out;
    for (char c : text) out.push_back(std::isalnum(static_cast<unsigned char>(c)) ? c : '_');
    return out;
}

// RAII for the NVRTC program and the nvJitLink handle.
struct NvrtcProgram {
    nvrtcProgram prog = nullptr;
    ~NvrtcProgram() {
        if (prog) nvrtcDestroyProgram(&prog);
    }
};
struct JitLinkHandle {
    nvJitLinkHandle handle = nullptr;
    ~JitLinkHandle() {
        if (handle) nvJitLinkDestroy(&handle);
    }
};

/// The error of a failed NVRTC call, naming the call and, for a call on a compiled program, the kernel.
[[noreturn]] void nvrtc_fail(nvrtcResult status, const char* call, const std::string& kernel) {
    WEFT_FAIL("NVRTC call failed: " << call << " returned " << nvrtcGetErrorString(status)
                                    << (kernel.empty() ? std::string() : "\n  kernel: " + kernel));
}

#define WEFT_NVRTC_CHECK(call)                                                              \
    do {                                                                                    \
        const nvrtcResult weft_nvrtc_status_ = (call);                                      \
        if (weft_nvrtc_status_ != NVRTC_SUCCESS) nvrtc_fail(weft_nvrtc_status_, #call, {}); \
    } while (0)

/// WEFT_NVRTC_CHECK for the calls on a compiled program: `context` (a callable returning the kernel's description)
/// runs only on failure.
#define WEFT_NVRTC_CHECK_FOR(call, context)                                                          \
    do {                                                                                             \
        const nvrtcResult weft_nvrtc_status_ = (call);                                               \
        if (weft_nvrtc_status_ != NVRTC_SUCCESS) nvrtc_fail(weft_nvrtc_status_, #call, (context)()); \
    } while (0)

std::string nvjitlink_log(nvJitLinkHandle h, bool errors) {
    size_t size = 0;
    if ((errors ? nvJitLinkGetErrorLogSize(h, &size) : nvJitLinkGetInfoLogSize(h, &size)) != NVJITLINK_SUCCESS ||
        size == 0) {
        return {};
    }
    std::string log(size, '\0');
    if ((errors ? nvJitLinkGetErrorLog(h, log.data()) : nvJitLinkGetInfoLog(h, log.data())) != NVJITLINK_SUCCESS) {
        return {};
    }
    while (!log.empty() && log.back() == '\0') log.pop_back();
    return log;
}

void write_text(const fs::path& path, const void* data, size_t bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    WEFT_CHECK(out.good(), "cannot write " << path.string());
}

}  // namespace

// ---------------------------------------------------------------------------------------------------

namespace {

// The decimal number that ends right before `suffix`'s first occurrence in `line` (nullopt without one): plain
// scanning, which is all ptxas's fixed phrases need.
std::optional<int> number_before(const std::string& line, std::string_view suffix) {
    const size_t at = line.find(suffix);
    if (at == std::string::npos) return std::nullopt;
    size_t begin = at;
    while (begin > 0 && line[begin - 1] >= '0' && line[begin - 1] <= '9') --begin;
    if (begin == at || at - begin > 9) return std::nullopt;
    return std::stoi(line.substr(begin, at - begin));
}

}  // namespace

std::string Compiler::code_fingerprint() {
    // The options now (every compile reads WEFT_TRACE and WEFT_JIT_* again), the toolchain as loaded.
    Sha256 h;
    h.field("weft-code/1").field(toolchain_libraries_text()).field(apply_env_options(CompileOptions{}).canonical());
    return to_hex(h.finish()).substr(0, 16);
}

PtxasInfo parse_ptxas_info(const std::string& log, const std::string& lowered_name) {
    PtxasInfo info;
    std::istringstream in(log);
    std::string line;
    bool inside = false;
    while (std::getline(in, line)) {
        const bool entry = line.find("Compiling entry function '") != std::string::npos;
        if (entry) {
            if (inside) break;  // the next function starts
            inside = lowered_name.empty() || line.find("'" + lowered_name + "'") != std::string::npos;
        }
        if (!inside) continue;
        info.text += line + "\n";
        // "Used 168 registers, ..., 1024 bytes smem" and "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill
        // loads".
        if (line.find("Used ") != std::string::npos) {
            if (auto v = number_before(line, " registers")) info.registers = *v;
        }
        const auto frame = number_before(line, " bytes stack frame, ");
        const auto stores = number_before(line, " bytes spill stores, ");
        const auto loads = number_before(line, " bytes spill loads");
        if (frame && stores && loads) {
            info.stack_frame_bytes = *frame;
            info.spill_store_bytes = *stores;
            info.spill_load_bytes = *loads;
        }
        if (auto v = number_before(line, " bytes smem")) info.static_smem_bytes = *v;
    }
    return info;
}

CompilerConfig CompilerConfig::from_env() {
    CompilerConfig config;
    const bool disabled = env::get_bool("WEFT_JIT_DISABLE_CACHE").value_or(false);
    if (!disabled) {
        config.cache_dir = default_cache_dir();
        if (!config.cache_dir) {
            static std::once_flag once;
            std::call_once(once, [] {
                WEFT_LOG_NOTICE(
                    "jit: no cache folder (WEFT_CACHE_DIR, XDG_CACHE_HOME and HOME are all unset): "
                    "kernels compile in every process and autotuning is not kept; set WEFT_CACHE_DIR");
            });
        }
    }
    return config;
}

struct Compiler::Prepared {
    KernelSpec spec;  // options and arch resolved
    std::string source;
    std::string source_name;
    std::vector<HeaderDigest> headers;
    Digest key{};
    std::string key_hex;
};

Compiler::Compiler(CompilerConfig config) : config_(std::move(config)) {
    if (config_.roots) {
        roots_ = *config_.roots;
    } else {
        roots_ = find_include_roots();
        check_headers_match_library(roots_);
        roots_.cuda = find_cuda_include_dirs();
    }
    roots_.extra.insert(roots_.extra.begin(), config_.extra_include_roots.begin(), config_.extra_include_roots.end());
    if (config_.cache_dir) {
        try {
            disk_ = std::make_unique<DiskCache>(*config_.cache_dir);
        } catch (const Error& e) {
            WEFT_LOG_WARN("jit: disk cache disabled: " << e.what());
        }
    }
    toolkit_digest_ = toolkit_headers_digest(roots_.cuda);
    WEFT_LOG_DEBUG("jit: weft headers " << roots_.weft_include.string() << " and " << roots_.weft_kernels.string()
                                        << " (" << roots_.found_by << "); cache "
                                        << (disk_ ? disk_->dir().string() : std::string("off")));
}

Compiler::~Compiler() = default;

std::optional<fs::path> Compiler::cache_dir() const {
    if (!disk_) return std::nullopt;
    return disk_->dir();
}

CompilerStats Compiler::stats() const {
    CompilerStats s;
    s.memory_hits = stats_.memory_hits.load();
    s.disk_hits = stats_.disk_hits.load();
    s.misses = stats_.misses.load();
    s.compiles = stats_.compiles.load();
    s.failures = stats_.failures.load();
    s.corrupt_entries = stats_.corrupt_entries.load();
    s.loads = stats_.loads.load();
    return s;
}

std::string Compiler::resolve_arch(const std::string& requested) {
    std::string arch = requested;
    std::string source = "KernelSpec::arch";  // where the arch came from, for the errors below
    if (arch.empty()) {
        if (auto v = env::get("WEFT_JIT_ARCH"); v && !v->empty()) {
            arch = *v;
            source = "WEFT_JIT_ARCH";
        }
    }
    if (arch.empty()) {
        WEFT_CHECK(cuda_available(), "no arch to compile for: no GPU is visible; set KernelSpec::arch or "
                                     "WEFT_JIT_ARCH (e.g. sm_90a)");
        int device = 0, major = 0, minor = 0;
        WEFT_CUDA_CHECK(cudaGetDevice(&device));
        WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
        // From Hopper on, the "a" variant unlocks the architecture-specific instructions (wgmma, setmaxnreg).
        arch = "sm_" + std::to_string(major * 10 + minor) + (major >= 9 ? "a" : "");
        source = "the GPU";
    }
    // sm_<2 or 3 digits>[a|f]
    size_t digits = 0;
    while (3 + digits < arch.size() && arch[3 + digits] >= '0' && arch[3 + digits] <= '9') ++digits;
    const size_t rest = arch.size() - std::min(arch.size(), 3 + digits);
    const bool well_formed = arch.rfind("sm_", 0) == 0 && digits >= 2 && digits <= 3 &&
                             (rest == 0 || (rest == 1 && (arch.back() == 'a' || arch.back() == 'f')));
    WEFT_CHECK(well_formed, source << ": arch must look like sm_90a (sm_<number>[a|f]), got '" << arch << "'");
    int num = 0;
    WEFT_NVRTC_CHECK(nvrtcGetNumSupportedArchs(&num));
    std::vector<int> supported(static_cast<size_t>(num));
    WEFT_NVRTC_CHECK(nvrtcGetSupportedArchs(supported.data()));
    const int sm = std::stoi(arch.substr(3, digits));
    if (std::find(supported.begin(), supported.end(), sm) == supported.end()) {
        std::ostringstream os;
        for (int s : supported) os << " sm_" << s;
        WEFT_FAIL(source << ": arch '" << arch << "' is not supported by NVRTC " << nvrtc_version_text()
                         << "; supported:" << os.str());
    }
    return arch;
}

std::string Compiler::generate_source(const KernelSpec& spec) {
    std::ostringstream os;
    os << "// Generated by weft::jit: instantiates " << one_line(spec.instantiation) << "\n";
    if (!spec.preamble.empty()) os << spec.preamble << "\n";
    // Angle brackets: searched in the include roots only, never in the process' working directory.
    os << "#include <" << spec.header << ">\n";
    if (!spec.extra_code.empty()) os << spec.extra_code << "\n";
    return os.str();
}

Compiler::Prepared Compiler::prepare(const KernelSpec& spec_in) const {
    WEFT_CHECK(!spec_in.header.empty(), "KernelSpec.header must name a header to include, got an empty string");
    WEFT_CHECK(!spec_in.instantiation.empty(),
               "KernelSpec.instantiation must name a __global__ function, got an empty string (header "
                   << spec_in.header << ")");
    Prepared p;
    p.spec = spec_in;
    p.spec.arch = resolve_arch(spec_in.arch);
    if (config_.apply_env_options) p.spec.options = apply_env_options(spec_in.options);
    p.spec.options.check();
    const auto weft_roots = roots_.weft_roots();
    {
        bool found = false;
        for (const auto& root : weft_roots) {
            std::error_code ec;
            found = found || fs::is_regular_file(root / spec_in.header, ec);
        }
        std::ostringstream os;
        for (const auto& root : weft_roots) os << " " << root.string();
        WEFT_CHECK(found, "KernelSpec.header '" << spec_in.header << "' (for " << spec_in.describe()
                                                << ") is not under any include root:" << os.str());
    }
    p.source = generate_source(p.spec);
    DependencyScanner scanner(weft_roots);
    scanner.scan(p.source, fs::path(), fs::path());
    p.headers = scanner.sorted();

    Sha256 h;
    h.field("weft-jit-key/3").field(WEFT_VERSION_STRING).field(toolchain_libraries_text());
    h.field(toolkit_digest_);
    h.field(std::to_string(CUDA_VERSION)).field(p.spec.arch).field(p.spec.options.canonical());
    h.field(p.spec.instantiation).field(p.source);
    for (const auto& hd : p.headers) h.field(hd.name).field(hd.digest);
    for (const auto& file : p.spec.options.link_files) {
        std::error_code ec;
        WEFT_CHECK(fs::is_regular_file(file, ec),
                   "CompileOptions.link_files: '" << file << "' (for " << spec_in.describe() << ") is not a file");
        const std::vector<char> bytes = read_file_bytes(file);
        h.field(fs::path(file).filename().string()).field(to_hex(sha256(bytes.data(), bytes.size())));
    }
    p.key = h.finish();
    p.key_hex = to_hex(p.key);
    p.source_name = "weft_jit_" + sanitize(fs::path(spec_in.header).stem().string()) + "_" + p.key_hex.substr(0, 12) + ".cu";
    return p;
}

std::string Compiler::cache_key(const KernelSpec& spec) const { return prepare(spec).key_hex; }

DiskCache::LoadStatus Compiler::disk_status(const KernelSpec& spec) const {
    if (!disk_) return DiskCache::LoadStatus::kAbsent;
    CacheEntry entry;
    return disk_->load(prepare(spec).key, &entry);
}

namespace {

// Inside warm(): its own lines report each compile, compile() adds none.
thread_local bool t_in_warm = false;

// Progress lines (notice) come from rank 0 or a thread without a rank: every rank waits alike, one says so.
LogLevel progress_level() { return log_rank() <= 0 ? LogLevel::kNotice : LogLevel::kInfo; }

struct Compiled {
    CacheEntry entry;
    std::string ptx;
};

// A hint to append to NVRTC's log when it could not open a C++ (or C) standard library header, which NVRTC does not
// have; empty otherwise.
std::string missing_standard_header_hint(const std::string& log) {
    // The standard headers a kernel header is likely to reach for, each between spaces.
    static constexpr std::string_view kStandard =
        " algorithm array atomic bit bitset cassert cctype cerrno cfloat charconv chrono cinttypes climits cmath"
        " compare complex concepts cstdarg cstddef cstdint cstdio cstdlib cstring ctime exception functional"
        " initializer_list iostream iterator limits memory new numeric optional ratio span string string_view tuple"
        " type_traits utility variant vector version assert.h float.h limits.h math.h stddef.h stdint.h stdio.h"
        " stdlib.h string.h ";
    static constexpr std::string_view kNeedle = "cannot open source file \"";
    for (size_t at = log.find(kNeedle); at != std::string::npos; at = log.find(kNeedle, at + 1)) {
        const size_t begin = at + kNeedle.size();
        const size_t end = log.find('"', begin);
        if (end == std::string::npos) break;
        const std::string name = log.substr(begin, end - begin);
        if (!name.empty() && kStandard.find(" " + name + " ") != std::string_view::npos) {
            return "\nhint: NVRTC has no C++ standard library (<" + name +
                   ">): weft's JIT headers include weft/common/macros.hpp for the fixed-width integers and "
                   "<cuda/std/...> for the rest (docs/jit.md, \"No standard library under NVRTC\")\n";
        }
    }
    return {};
}

Compiled run_toolchain(const KernelSpec& spec, const std::string& source, const std::string& source_name,
                       const IncludeRoots& roots) {
    const CompileOptions& o = spec.options;
    auto context = [&] {
        std::ostringstream os;
        os << spec.describe() << "\n  source: " << source_name << " (arch " << spec.arch
           << ")\n  header: " << spec.header << "\n  instantiation: " << spec.instantiation
           << "\n  options: " << o.describe();
        return os.str();
    };

    NvrtcProgram program;
    WEFT_NVRTC_CHECK(nvrtcCreateProgram(&program.prog, source.c_str(), source_name.c_str(), 0, nullptr, nullptr));
    WEFT_NVRTC_CHECK(nvrtcAddNameExpression(program.prog, spec.instantiation.c_str()));

    std::vector<std::string> flags = {"-std=c++20", "-arch=" + spec.arch};
    if (o.lto) {
        flags.push_back("-dlto");
    } else {
        if (!o.link_files.empty()) flags.push_back("-rdc=true");
        flags.push_back("--ptxas-options=-v");  // the register/spill report, always captured
    }
    if (o.lineinfo) flags.push_back("-lineinfo");
    if (o.max_registers > 0) flags.push_back("--maxrregcount=" + std::to_string(o.max_registers));
    for (const auto& d : o.defines) flags.push_back("-D" + d);
    for (const auto& root : roots.weft_roots()) flags.push_back("-I" + root.string());
    for (const auto& root : roots.cuda) flags.push_back("-I" + root.string());
    for (const auto& f : o.extra_flags) flags.push_back(f);
    std::vector<const char*> argv;
    for (const auto& f : flags) argv.push_back(f.c_str());

    const nvrtcResult status = nvrtcCompileProgram(program.prog, static_cast<int>(argv.size()), argv.data());
    size_t log_size = 0;
    std::string log;
    if (nvrtcGetProgramLogSize(program.prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
        log.resize(log_size);
        nvrtcGetProgramLog(program.prog, log.data());
        while (!log.empty() && log.back() == '\0') log.pop_back();
    }
    if (status != NVRTC_SUCCESS) {
        log += missing_standard_header_hint(log);
        WEFT_FAIL("jit: NVRTC could not compile " << context() << "\nNVRTC (" << nvrtcGetErrorString(status)
                                                 << ") log:\n" << log << "\nGenerated source:\n" << source);
    }

    Compiled out;
    const char* lowered = nullptr;
    WEFT_NVRTC_CHECK_FOR(nvrtcGetLoweredName(program.prog, spec.instantiation.c_str(), &lowered), context);
    out.entry.lowered_name = lowered;

    if (!o.lto) {
        size_t ptx_size = 0;
        if (nvrtcGetPTXSize(program.prog, &ptx_size) == NVRTC_SUCCESS && ptx_size > 1) {
            out.ptx.resize(ptx_size);
            WEFT_NVRTC_CHECK_FOR(nvrtcGetPTX(program.prog, out.ptx.data()), context);
            while (!out.ptx.empty() && out.ptx.back() == '\0') out.ptx.pop_back();
        }
    }

    std::vector<char> image;  // NVRTC's output: a cubin (maybe relocatable) or LTO-IR
    if (o.lto) {
        size_t size = 0;
        WEFT_NVRTC_CHECK_FOR(nvrtcGetLTOIRSize(program.prog, &size), context);
        image.resize(size);
        WEFT_NVRTC_CHECK_FOR(nvrtcGetLTOIR(program.prog, image.data()), context);
    } else {
        size_t size = 0;
        WEFT_NVRTC_CHECK_FOR(nvrtcGetCUBINSize(program.prog, &size), context);
        image.resize(size);
        WEFT_NVRTC_CHECK_FOR(nvrtcGetCUBIN(program.prog, image.data()), context);
    }
    WEFT_CHECK(!image.empty(), "jit: NVRTC produced no output for " << context());

    if (!o.needs_link()) {
        out.entry.cubin = std::move(image);
        out.entry.log = std::move(log);
        return out;
    }

    // nvJitLink: LTO, or relocatable code + device libraries -> one loadable cubin.
    std::vector<std::string> link_flags = {"-arch=" + spec.arch, "-verbose"};
    if (o.lto) link_flags.push_back("-lto");
    if (o.lineinfo) link_flags.push_back("-lineinfo");
    if (o.max_registers > 0) link_flags.push_back("-maxrregcount=" + std::to_string(o.max_registers));
    std::vector<const char*> link_argv;
    for (const auto& f : link_flags) link_argv.push_back(f.c_str());
    JitLinkHandle link;
    nvJitLinkResult ls = nvJitLinkCreate(&link.handle, static_cast<uint32_t>(link_argv.size()), link_argv.data());
    WEFT_CHECK(ls == NVJITLINK_SUCCESS, "jit: nvJitLinkCreate failed (" << static_cast<int>(ls) << ") for " << context());
    auto link_fail = [&](const std::string& what, nvJitLinkResult r) {
        WEFT_FAIL("jit: nvJitLink " << what << " failed (status " << static_cast<int>(r) << ") for " << context()
                                    << "\nnvJitLink error log:\n" << nvjitlink_log(link.handle, true)
                                    << "\nnvJitLink info log:\n" << nvjitlink_log(link.handle, false));
    };
    ls = nvJitLinkAddData(link.handle, o.lto ? NVJITLINK_INPUT_LTOIR : NVJITLINK_INPUT_CUBIN, image.data(),
                          image.size(), source_name.c_str());
    if (ls != NVJITLINK_SUCCESS) link_fail("adding " + source_name, ls);
    for (const auto& file : o.link_files) {
        ls = nvJitLinkAddFile(link.handle, NVJITLINK_INPUT_ANY, file.c_str());
        if (ls != NVJITLINK_SUCCESS) link_fail("adding " + file, ls);
    }
    ls = nvJitLinkComplete(link.handle);
    if (ls != NVJITLINK_SUCCESS) link_fail("linking", ls);
    size_t cubin_size = 0;
    ls = nvJitLinkGetLinkedCubinSize(link.handle, &cubin_size);
    if (ls != NVJITLINK_SUCCESS) link_fail("getting the cubin size", ls);
    out.entry.cubin.resize(cubin_size);
    ls = nvJitLinkGetLinkedCubin(link.handle, out.entry.cubin.data());
    if (ls != NVJITLINK_SUCCESS) link_fail("getting the cubin", ls);
    out.entry.log = log;
    if (!out.entry.log.empty() && out.entry.log.back() != '\n') out.entry.log += '\n';
    out.entry.log += nvjitlink_log(link.handle, false);
    return out;
}

}  // namespace

void Compiler::dump(const Prepared& p, const CompileResult& r) const {
    const std::string& dir = p.spec.options.dump_dir;
    if (dir.empty()) return;
    try {
        std::error_code ec;
        fs::create_directories(dir, ec);
        const fs::path base = fs::path(dir) / fs::path(p.source_name).stem();
        write_text(base.string() + ".cu", p.source.data(), p.source.size());
        if (!r.ptx.empty()) write_text(base.string() + ".ptx", r.ptx.data(), r.ptx.size());
        if (r.cubin) write_text(base.string() + ".cubin", r.cubin->data(), r.cubin->size());
        std::ostringstream log;
        log << "# " << p.spec.describe() << "\n# key " << p.key_hex << ", arch " << p.spec.arch << ", "
            << (r.origin == CompileResult::Origin::kCompiled ? "compiled" : "from the cache (no PTX)") << "\n"
            << "# lowered name " << r.lowered_name << "\n" << r.log;
        const std::string text = log.str();
        write_text(base.string() + ".log", text.data(), text.size());
    } catch (const std::exception& e) {
        WEFT_LOG_WARN("jit: cannot dump " << p.source_name << " to " << dir << ": " << e.what());
    }
}

CompileResult Compiler::compile(const KernelSpec& spec) {
    const Prepared p = prepare(spec);
    CompileResult result;
    result.key = p.key_hex;
    result.arch = p.spec.arch;
    result.source_name = p.source_name;
    result.source = p.source;
    for (const auto& hd : p.headers) result.headers.push_back(hd.name);
    auto finish = [&](const std::shared_ptr<const CacheEntry>& entry, CompileResult::Origin origin) {
        result.origin = origin;
        result.lowered_name = entry->lowered_name;
        result.cubin = std::shared_ptr<const std::vector<char>>(entry, &entry->cubin);
        result.log = entry->log;
        result.ptxas_info = parse_ptxas_info(entry->log, entry->lowered_name);
        if (origin != CompileResult::Origin::kMemory) dump(p, result);
        return result;
    };

    std::shared_ptr<std::mutex> key_mutex;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (auto it = memory_.find(p.key_hex); it != memory_.end()) {
            ++stats_.memory_hits;
            return finish(it->second, CompileResult::Origin::kMemory);
        }
        auto& m = key_mutexes_[p.key_hex];
        if (!m) m = std::make_shared<std::mutex>();
        key_mutex = m;
    }
    // One compile per key in this process; the file lock below extends that to other processes.
    std::lock_guard<std::mutex> key_lock(*key_mutex);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (auto it = memory_.find(p.key_hex); it != memory_.end()) {
            ++stats_.memory_hits;
            return finish(it->second, CompileResult::Origin::kMemory);
        }
    }
    auto remember = [&](CacheEntry&& e) {
        auto shared = std::make_shared<const CacheEntry>(std::move(e));
        std::lock_guard<std::mutex> lock(mutex_);
        memory_[p.key_hex] = shared;
        return shared;
    };
    auto disk_hit = [&](CacheEntry&& e) {
        ++stats_.disk_hits;
        WEFT_LOG_INFO("jit: cache hit for " << p.spec.describe() << " [" << p.key_hex.substr(0, 12) << "] from "
                                            << disk_->entry_path(p.key).string());
        return finish(remember(std::move(e)), CompileResult::Origin::kDisk);
    };

    std::optional<FileLock> file_lock;
    if (disk_) {
        CacheEntry entry;
        if (disk_->load(p.key, &entry) == DiskCache::LoadStatus::kHit) return disk_hit(std::move(entry));
        if (!disk_store_failed_.load()) file_lock.emplace(disk_->lock_path(p.key), config_.lock_timeout);
        if (file_lock && file_lock->timed_out()) {
            WEFT_LOG_WARN("jit: could not lock the cache entry of " << p.spec.describe() << " within "
                                                                    << config_.lock_timeout.count()
                                                                    << " ms; compiling without the lock");
        }  // else refused at once, and said why
        // Whoever held the lock may have written the entry meanwhile.
        std::string why;
        const auto status = disk_->load(p.key, &entry, &why);
        if (status == DiskCache::LoadStatus::kHit) return disk_hit(std::move(entry));
        if (status == DiskCache::LoadStatus::kCorrupt) {
            ++stats_.corrupt_entries;
            WEFT_LOG_WARN("jit: corrupt cache entry " << disk_->entry_path(p.key).string() << " (" << why
                                                      << "); deleting it and recompiling " << p.spec.describe());
            disk_->remove(p.key);
        }
    }

    ++stats_.misses;
    if (!t_in_warm) {
        WEFT_LOG(progress_level(), "jit: compiling " << p.spec.describe() << " for " << p.spec.arch
                                                     << " (first use; cached afterwards)");
    }
    const NvtxRange nvtx_compile(("jit compile " + p.spec.describe()).c_str());
    const auto start = std::chrono::steady_clock::now();
    Compiled compiled;
    try {
        compiled = run_toolchain(p.spec, p.source, p.source_name, roots_);
    } catch (const Error& e) {
        ++stats_.failures;
        if (!p.spec.options.dump_dir.empty()) {
            CompileResult failed = result;
            failed.log = std::string("# compilation failed\n") + e.what() + "\n";
            dump(p, failed);
        }
        throw;
    }
    ++stats_.compiles;
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    // A source edited while the toolchain ran: the binary may not be what the key names (it hashes the sources as
    // they were before). Kept nowhere, neither on disk nor in memory: the next call compiles again.
    bool sources_unchanged = false;
    try {
        sources_unchanged = prepare(spec).key == p.key;
    } catch (const std::exception&) {
        // A header gone or unreadable now: changed.
    }
    if (!sources_unchanged) {
        WEFT_LOG_WARN("jit: a source of " << p.spec.describe()
                                          << " changed while it compiled; the kernel is used but not cached");
        file_lock.reset();
        result.ptx = std::move(compiled.ptx);
        return finish(std::make_shared<const CacheEntry>(std::move(compiled.entry)), CompileResult::Origin::kCompiled);
    }
    if (disk_ && !disk_store_failed_.load()) {
        try {
            disk_->store(p.key, compiled.entry);
        } catch (const Error& e) {
            disk_store_failed_ = true;
            WEFT_LOG_WARN("jit: cannot store " << p.spec.describe() << " in the cache: " << e.what()
                                               << "; this process stores no more kernels there");
        }
    }
    file_lock.reset();
    result.ptx = std::move(compiled.ptx);
    CompileResult r = finish(remember(std::move(compiled.entry)), CompileResult::Origin::kCompiled);
    WEFT_LOG_INFO("jit: compiled " << p.spec.describe() << " [" << p.key_hex.substr(0, 12) << "] for " << p.spec.arch
                                   << " in " << static_cast<int>(ms) << " ms: " << r.ptxas_info.registers
                                   << " registers, spills " << r.ptxas_info.spill_store_bytes << "/"
                                   << r.ptxas_info.spill_load_bytes << " bytes (store/load)");
    if (p.spec.options.verbose_ptxas) {
        // Explicitly requested output: shown whatever WEFT_LOG says.
        log_line(LogSubsystem::kJit, LogLevel::kInfo, "jit: ptxas report for " + p.spec.describe() + ":\n" + r.log);
    }
    return r;
}

bool Compiler::is_cached(const KernelSpec& spec) const {
    const Prepared p = prepare(spec);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (memory_.count(p.key_hex) != 0) return true;
    }
    if (!disk_) return false;
    CacheEntry entry;
    return disk_->load(p.key, &entry) == DiskCache::LoadStatus::kHit;
}

size_t Compiler::warm(const std::vector<KernelSpec>& specs, const std::string& what) {
    std::vector<const KernelSpec*> missing;
    for (const KernelSpec& spec : specs) {
        if (!is_cached(spec)) missing.push_back(&spec);
    }
    if (missing.empty()) return 0;
    const LogLevel level = progress_level();
    WEFT_LOG(level, "jit: compiling " << missing.size() << " of " << specs.size() << " kernels for " << what
                                      << " (first use; cached afterwards)");
    const auto start = std::chrono::steady_clock::now();
    struct InWarm {
        InWarm() { t_in_warm = true; }
        ~InWarm() { t_in_warm = false; }
    } in_warm;
    // Ranks warming the same list start at different kernels (each rank at its own place in it): a kernel another
    // rank compiles is waited for under its key's lock, so from one start every rank would queue behind the first.
    const size_t first = log_rank() > 0 ? static_cast<size_t>(log_rank()) % missing.size() : 0;
    for (size_t i = 0; i < missing.size(); ++i) {
        const KernelSpec& spec = *missing[(first + i) % missing.size()];
        const auto t0 = std::chrono::steady_clock::now();
        const CompileResult r = compile(spec);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        WEFT_LOG(level, "jit: [" << i + 1 << "/" << missing.size() << "] " << spec.describe()
                                 << (r.origin == CompileResult::Origin::kCompiled ? " compiled in "
                                                                                  : " found in the cache after ")
                                 << format_duration(s));
    }
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    WEFT_LOG(level, "jit: " << missing.size() << " kernels for " << what << " ready in " << format_duration(total));
    return missing.size();
}

Kernel& Compiler::get_kernel(const KernelSpec& spec) {
    // The memo key: everything that selects the compiled code, without hashing any file.
    const std::string arch = resolve_arch(spec.arch);
    const CompileOptions options = config_.apply_env_options ? apply_env_options(spec.options) : spec.options;
    Sha256 h;
    h.field(spec.header).field(spec.instantiation).field(spec.preamble).field(spec.extra_code).field(arch);
    h.field(options.canonical());
    for (const auto& f : options.link_files) h.field(f);
    const std::string memo = to_hex(h.finish());
    // The driver calls (loading the library, its function in this context) run outside mutex_: a rank thread whose
    // call waits in the driver must not hold up the other rank threads' lookups (Kernel has a lock of its own).
    Kernel* kernel = nullptr;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (auto it = spec_memo_.find(memo); it != spec_memo_.end()) {
            kernel = it->second;
            ++stats_.memory_hits;
        }
    }
    if (kernel != nullptr) {
        kernel->load_for_current_context();
        return *kernel;
    }
    KernelSpec resolved = spec;
    resolved.arch = arch;
    const CompileResult r = compile(resolved);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (auto it = kernels_.find(r.key); it != kernels_.end() && it->second) kernel = it->second.get();
    }
    std::unique_ptr<Kernel> loaded;  // destroyed (unloaded) outside the lock when another thread loaded it first
    if (kernel == nullptr) {
        loaded = std::make_unique<Kernel>(spec.describe(), r.lowered_name, r.cubin);
        std::lock_guard<std::mutex> lock(mutex_);
        auto& slot = kernels_[r.key];
        if (!slot) {
            slot = std::move(loaded);
            ++stats_.loads;
            WEFT_LOG_INFO("jit: loaded " << spec.describe() << " ("
                                         << (r.origin == CompileResult::Origin::kCompiled ? "compiled" : "cache hit")
                                         << ")");
        }
        kernel = slot.get();
    }
    {
        std::lock_guard<std::mutex> lock(mutex_);
        spec_memo_[memo] = kernel;
    }
    kernel->load_for_current_context();
    return *kernel;
}

Compiler& compiler() {
    // Never destroyed: kernels handed out must outlive every static destructor that might launch.
    static Compiler* instance = new Compiler(CompilerConfig::from_env());
    return *instance;
}

Compiler& compiler(const std::filesystem::path& extra_root) {
    if (extra_root.empty()) return compiler();
    std::error_code ec;
    std::filesystem::path root = std::filesystem::weakly_canonical(extra_root, ec);
    if (ec) root = extra_root;
    WEFT_CHECK(std::filesystem::is_directory(root, ec),
               "jit::compiler: the extra include root must be a directory, got '" << extra_root.string() << "'");
    static std::mutex mutex;
    // Never destroyed, as compiler()'s: the kernels a compiler loads must stay valid until the process ends.
    static auto* compilers = new std::map<std::string, std::unique_ptr<Compiler>>();
    std::lock_guard<std::mutex> lock(mutex);
    std::unique_ptr<Compiler>& c = (*compilers)[root.string()];
    if (!c) {
        CompilerConfig config = CompilerConfig::from_env();
        config.extra_include_roots.push_back(root);
        c = std::make_unique<Compiler>(std::move(config));
    }
    return *c;
}

Kernel& get_kernel(const std::string& header, const std::string& instantiation) {
    KernelSpec spec;
    spec.header = header;
    spec.instantiation = instantiation;
    return compiler().get_kernel(spec);
}

}  // namespace weft::jit
