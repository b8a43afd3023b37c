// SPDX-License-Identifier: MIT
// Run-time discovery of weft's include roots, the toolkit's headers and the cache folder.
#include "weft/jit/paths.hpp"

#include <dlfcn.h>
#include <link.h>
#include <nvrtc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "weft/detail/install_prefix.hpp"
#include "weft/jit/cache.hpp"
#include "weft/jit/hash.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"

namespace weft::jit {

namespace fs = std::filesystem;

namespace {

bool is_file(const fs::path& p) {
    std::error_code ec;
    return fs::is_regular_file(p, ec);
}
bool is_dir(const fs::path& p) {
    std::error_code ec;
    return fs::is_directory(p, ec);
}

fs::path canonical_or_same(const fs::path& p) {
    std::error_code ec;
    fs::path c = fs::weakly_canonical(p, ec);
    return ec ? p : c;
}

// The folder of the running executable and of the file weft's own code lives in (the same file for a
// static weft; the shared library when weft is built shared).
std::vector<fs::path> search_starts() {
    std::vector<fs::path> starts;
    std::error_code ec;
    fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) starts.push_back(exe.parent_path());
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&find_include_roots), &info) != 0 && info.dli_fname != nullptr) {
        fs::path lib = canonical_or_same(info.dli_fname);
        if (starts.empty() || lib.parent_path() != starts.front()) starts.push_back(lib.parent_path());
    }
    return starts;
}

// The path of the loaded libnvrtc, found among the loaded objects (robust against PLT addresses).
int find_nvrtc(struct dl_phdr_info* info, size_t, void* data) {
    if (info->dlpi_name == nullptr) return 0;
    const char* name = info->dlpi_name;
    const char* slash = std::strrchr(name, '/');
    const char* base = slash ? slash + 1 : name;
    if (std::strncmp(base, "libnvrtc.", 9) == 0 || std::strncmp(base, "libnvrtc.alt.", 13) == 0) {
        *static_cast<std::string*>(data) = name;
        return 1;
    }
    return 0;
}

}  // namespace

std::vector<fs::path> IncludeRoots::weft_roots() const {
    std::vector<fs::path> roots = extra;
    roots.push_back(weft_include);
    roots.push_back(weft_kernels);
    return roots;
}

std::optional<IncludeRoots> weft_roots_at(const fs::path& dir) {
    if (!is_file(dir / "include" / "weft" / "device" / "token.cuh")) return std::nullopt;
    IncludeRoots roots;
    roots.weft_include = canonical_or_same(dir / "include");
    if (is_dir(dir / "kernels")) {
        roots.weft_kernels = canonical_or_same(dir / "kernels");
        return roots;
    }
    if (is_dir(dir / "share" / "weft" / "kernels")) {
        roots.weft_kernels = canonical_or_same(dir / "share" / "weft" / "kernels");
        return roots;
    }
    return std::nullopt;
}

// Generated (cmake/weft_headers_digest.cmake): the headers of include/weft/common this library was built from.
const std::vector<std::string>& built_common_header_names();
std::string built_common_headers_digest();

std::string common_headers_digest(const fs::path& weft_include, const std::vector<std::string>& names_in) {
    const fs::path dir = weft_include / "weft" / "common";
    std::vector<std::string> names = names_in;
    std::sort(names.begin(), names.end());
    std::string lines;
    for (const std::string& name : names) {
        WEFT_CHECK(is_file(dir / name), "jit: " << (dir / name).string() << " is missing");
        const std::vector<char> bytes = read_file_bytes(dir / name);
        lines += name + ":" + to_hex(sha256(bytes.data(), bytes.size())) + "\n";
    }
    return to_hex(sha256(lines));
}

namespace {

// Why the headers at `roots` are not this library's (a header of include/weft/common missing or different), or
// nullopt when they are.
std::optional<std::string> headers_mismatch(const IncludeRoots& roots) {
    try {
        if (common_headers_digest(roots.weft_include, built_common_header_names()) == built_common_headers_digest()) {
            return std::nullopt;
        }
        return std::string("a header of include/weft/common differs");
    } catch (const Error& e) {
        return std::string(e.what());
    }
}

}  // namespace

void check_headers_match_library(const IncludeRoots& roots) {
    const auto mismatch = [&](const std::string& what) {
        WEFT_FAIL("jit: weft's headers at " << roots.weft_include.string() << " (" << roots.found_by
                                            << ") are not the ones this library was built from (" << what
                                            << ": kernels compiled from them would disagree with the library on "
                                               "their parameters); set WEFT_HOME to this build's source tree or "
                                               "install prefix, or rebuild the library");
    };
    std::string found;
    try {
        found = common_headers_digest(roots.weft_include, built_common_header_names());
    } catch (const Error& e) {
        mismatch(e.what());
    }
    if (found != built_common_headers_digest()) mismatch("a header of include/weft/common differs");
}

IncludeRoots find_include_roots() {
    if (auto home = env::get("WEFT_HOME"); home && !home->empty()) {
        auto roots = weft_roots_at(*home);
        WEFT_CHECK(roots.has_value(), "WEFT_HOME='" << *home
                                                    << "' must hold include/weft/device/token.cuh and either "
                                                       "kernels/ (a source tree) or share/weft/kernels/ (an "
                                                       "install prefix); it does not");
        roots->found_by = "WEFT_HOME=" + *home;
        return *roots;
    }
    // A tree of another weft (an older install beside the program, a source tree of another version above it) is
    // passed over for the next place, the install prefix compiled into weft last.
    return search_include_roots(search_starts(), detail::installed_prefix(), headers_mismatch);
}

IncludeRoots search_include_roots(const std::vector<fs::path>& starts, const fs::path& install_prefix,
                                  const std::function<std::optional<std::string>(const IncludeRoots&)>& reject) {
    std::vector<std::string> searched;
    std::vector<std::string> rejected;
    const auto take = [&](std::optional<IncludeRoots>& roots, const fs::path& dir) {
        if (!roots) return false;
        if (reject) {
            if (const std::optional<std::string> why = reject(*roots)) {
                rejected.push_back(dir.string() + ": " + *why);
                return false;
            }
        }
        return true;
    };
    for (const fs::path& start : starts) {
        for (fs::path dir = start; !dir.empty(); dir = dir.parent_path()) {
            if (auto roots = weft_roots_at(dir); take(roots, dir)) {
                roots->found_by = "searched upward from " + start.string() + ", found " + dir.string();
                return *roots;
            }
            searched.push_back(dir.string());
            if (dir == dir.root_path()) break;
        }
    }
    if (!install_prefix.empty()) {
        if (auto roots = weft_roots_at(install_prefix); take(roots, install_prefix)) {
            roots->found_by = "the install prefix compiled into weft, " + install_prefix.string();
            return *roots;
        }
        searched.push_back(install_prefix.string() + " (the install prefix compiled into weft)");
    }
    std::ostringstream os;
    if (!rejected.empty()) {
        for (const auto& s : rejected) os << "\n  " << s;
        WEFT_FAIL(
            "cannot find the weft headers this library was built from for the JIT: every weft tree found holds "
            "other headers (kernels compiled from them would disagree with the library on their parameters); "
            "set WEFT_HOME to this build's source tree or install prefix, or rebuild the library. Found:"
            << os.str());
    }
    for (const auto& s : searched) os << "\n  " << s;
    WEFT_FAIL("cannot find weft's headers (include/weft/device/token.cuh with kernels/ or share/weft/kernels/) "
              "for the JIT; set WEFT_HOME to the source tree or install prefix. Searched:"
              << os.str());
}

namespace {

// The CUDA major version of the toolkit headers in `inc` (cuda.h's CUDA_VERSION / 1000), or 0 when it cannot be read.
int headers_cuda_major(const fs::path& inc) {
    std::ifstream in(inc / "cuda.h");
    std::string line;
    while (std::getline(in, line)) {
        const std::string tag = "#define CUDA_VERSION ";
        if (line.rfind(tag, 0) == 0) return std::atoi(line.c_str() + tag.size()) / 1000;
    }
    return 0;
}

}  // namespace

std::vector<fs::path> find_cuda_include_dirs() {
    std::vector<fs::path> candidates;
    std::vector<std::string> why;
    int nvrtc_major = 0, nvrtc_minor = 0;
    if (nvrtcVersion(&nvrtc_major, &nvrtc_minor) != NVRTC_SUCCESS) nvrtc_major = 0;
    for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
        if (auto v = env::get(var); v && !v->empty()) {
            fs::path inc = fs::path(*v) / "include";
            WEFT_CHECK(is_file(inc / "cuda_fp16.h"),
                       var << "='" << *v << "' is set but " << inc.string() << "/cuda_fp16.h does not exist");
            // NVRTC compiles against these headers: another major version's (a CUDA 12 toolkit set for building
            // PyTorch extensions beside this CUDA 13 NVRTC) would fail in ways that do not say why. Passed over for
            // the headers beside the NVRTC weft runs, with a warning.
            const int major = headers_cuda_major(inc);
            if (major != 0 && nvrtc_major != 0 && major != nvrtc_major) {
                WEFT_LOG_WARN("jit: " << var << "='" << *v << "' holds the headers of CUDA " << major
                                      << ", but weft's JIT runs NVRTC " << nvrtc_major << "." << nvrtc_minor
                                      << ", which needs its own toolkit's headers: not using them (point " << var
                                      << " at a CUDA " << nvrtc_major << " toolkit to choose one)");
                why.push_back(inc.string() + " (CUDA " + std::to_string(major) + " headers, NVRTC " +
                              std::to_string(nvrtc_major) + ")");
                continue;
            }
            candidates.push_back(inc);
        }
    }
    std::string nvrtc;
    dl_iterate_phdr(find_nvrtc, &nvrtc);
    if (!nvrtc.empty()) {
        // <toolkit>/lib64/libnvrtc.so -> <toolkit>/include; also the symlink-resolved location,
        // e.g. <toolkit>/targets/x86_64-linux/lib -> ../include.
        for (const fs::path& lib : {fs::path(nvrtc), canonical_or_same(nvrtc)}) {
            fs::path dir = lib.parent_path();
            for (int up = 0; up < 3 && !dir.empty(); ++up, dir = dir.parent_path()) {
                candidates.push_back(dir.parent_path() / "include");
            }
        }
    } else {
        why.push_back("(libnvrtc is not among the loaded objects)");
    }
    candidates.push_back("/usr/local/cuda/include");
    for (const auto& inc : candidates) {
        if (is_file(inc / "cuda_fp16.h")) {
            std::vector<fs::path> dirs{canonical_or_same(inc)};
            if (is_dir(inc / "cccl")) dirs.push_back(canonical_or_same(inc / "cccl"));
            return dirs;
        }
        why.push_back(inc.string());
    }
    std::ostringstream os;
    for (const auto& s : why) os << "\n  " << s;
    WEFT_FAIL("cannot find the CUDA toolkit's headers (cuda_fp16.h) for NVRTC; set CUDA_HOME. Searched:" << os.str());
}

std::string toolkit_headers_digest(const std::vector<fs::path>& cuda_dirs) {
    Sha256 h;
    h.field("toolkit-headers/1");
    for (const char* name : {"cuda.h", "cuda_fp16.hpp", "cuda_bf16.hpp", "cuda_fp8.hpp", "cuda/std/__cccl/version.h"}) {
        for (const fs::path& dir : cuda_dirs) {
            if (!is_file(dir / name)) continue;
            const std::vector<char> bytes = read_file_bytes(dir / name);
            h.field(name).field(to_hex(sha256(bytes.data(), bytes.size())));
            break;
        }
    }
    return to_hex(h.finish());
}

std::optional<fs::path> default_cache_dir() {
    if (auto v = env::get("WEFT_CACHE_DIR"); v && !v->empty()) return fs::path(*v);
    if (auto v = env::get("XDG_CACHE_HOME"); v && !v->empty()) return fs::path(*v) / "weft";
    if (auto v = env::get("HOME"); v && !v->empty()) return fs::path(*v) / ".cache" / "weft";
    return std::nullopt;
}

}  // namespace weft::jit
