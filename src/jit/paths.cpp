// SPDX-License-Identifier: MIT
// Run-time discovery of weft's include roots, the toolkit's headers and the cache folder.
#include "weft/jit/paths.hpp"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "weft/detail/install_prefix.hpp"
#include "weft/jit/cache.hpp"
#include "weft/jit/hash.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"

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
    return search_include_roots(search_starts(), detail::installed_prefix());
}

IncludeRoots search_include_roots(const std::vector<fs::path>& starts, const fs::path& install_prefix) {
    std::vector<std::string> searched;
    for (const fs::path& start : starts) {
        for (fs::path dir = start; !dir.empty(); dir = dir.parent_path()) {
            if (auto roots = weft_roots_at(dir)) {
                roots->found_by = "searched upward from " + start.string() + ", found " + dir.string();
                return *roots;
            }
            searched.push_back(dir.string());
            if (dir == dir.root_path()) break;
        }
    }
    if (!install_prefix.empty()) {
        if (auto roots = weft_roots_at(install_prefix)) {
            roots->found_by = "the install prefix compiled into weft, " + install_prefix.string();
            return *roots;
        }
        searched.push_back(install_prefix.string() + " (the install prefix compiled into weft)");
    }
    std::ostringstream os;
    for (const auto& s : searched) os << "\n  " << s;
    WEFT_FAIL("cannot find weft's headers (include/weft/device/token.cuh with kernels/ or share/weft/kernels/) "
              "for the JIT; set WEFT_HOME to the source tree or install prefix. Searched:"
              << os.str());
}

std::vector<fs::path> find_cuda_include_dirs() {
    std::vector<fs::path> candidates;
    std::vector<std::string> why;
    for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
        if (auto v = env::get(var); v && !v->empty()) {
            fs::path inc = fs::path(*v) / "include";
            WEFT_CHECK(is_file(inc / "cuda_fp16.h"),
                       var << "='" << *v << "' is set but " << inc.string() << "/cuda_fp16.h does not exist");
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
