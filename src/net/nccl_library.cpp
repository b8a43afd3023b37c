// SPDX-License-Identifier: MIT
// The process's libnccl: where it is looked for, opening it once, resolving entry points
// (weft/detail/nccl_library.hpp).
#include "weft/detail/nccl_library.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>

#include "weft/runtime/env.hpp"

namespace weft::detail {
namespace {

constexpr const char* kNcclLibrary = "libnccl.so.2";

// The folder of python3's nvidia.nccl package (NVIDIA's wheel), or "" when python3 or the package is absent, or
// python3 does not answer within 30 s (coreutils' timeout bounds the wait; without it, "" too).
std::string python_nccl_dir() {
    FILE* p = popen(
        "timeout 30 python3 -c \"import nvidia.nccl,os;print(os.path.dirname(nvidia.nccl.__file__ or "
        "nvidia.nccl.__path__[0]))\" 2>/dev/null",
        "r");
    if (p == nullptr) return "";
    char buf[4096] = {};
    const size_t n = std::fread(buf, 1, sizeof(buf) - 1, p);
    pclose(p);
    std::string s(buf, n);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    return s;
}

}  // namespace

NcclSearch NcclSearch::from_environment() {
    return {env::get("WEFT_NCCL_LIBRARY"), env::get("CUDA_HOME"), env::get("CUDA_PATH")};
}

std::vector<std::string> nccl_library_candidates(const NcclSearch& search) {
    if (search.weft_nccl_library && !search.weft_nccl_library->empty()) return {*search.weft_nccl_library};
    std::vector<std::string> out{kNcclLibrary};
    const auto add = [&](const std::string& c) {
        if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
    };
    for (const auto* root : {&search.cuda_home, &search.cuda_path}) {
        if (!*root || (*root)->empty()) continue;
        add(**root + "/lib/" + kNcclLibrary);
        add(**root + "/lib64/" + kNcclLibrary);
    }
    add(std::string("/usr/local/cuda/lib/") + kNcclLibrary);
    add(std::string("/usr/local/cuda/lib64/") + kNcclLibrary);
    return out;
}

std::vector<std::string> nccl_python_candidates(const std::string& dir) {
    if (dir.empty()) return {};
    return {dir + "/lib/" + kNcclLibrary, dir + "/" + kNcclLibrary};
}

const NcclLibrary& NcclLibrary::process() {
    // NOTE: never closed (the object is never destroyed): NCCL may still be running work at exit.
    static const NcclLibrary* const lib = [] {
        auto* l = new NcclLibrary();
        const NcclSearch search = NcclSearch::from_environment();
        const bool named = search.weft_nccl_library && !search.weft_nccl_library->empty();
        l->open_first(nccl_library_candidates(search));
        if (!l->loaded() && !named) l->open_first(nccl_python_candidates(python_nccl_dir()));
        if (!l->loaded()) {
            l->why_not_ = l->failure(named ? "; WEFT_NCCL_LIBRARY is set, so only that file was tried"
                                           : "; set WEFT_NCCL_LIBRARY to its path");
        }
        return l;
    }();
    return *lib;
}

NcclLibrary::NcclLibrary(const std::vector<std::string>& candidates) {
    open_first(candidates);
    if (!loaded()) why_not_ = failure("");
}

NcclLibrary::~NcclLibrary() {
    if (handle_ != nullptr) dlclose(handle_);
}

void NcclLibrary::open_first(const std::vector<std::string>& candidates) {
    for (const std::string& c : candidates) {
        handle_ = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (handle_ != nullptr) {
            path_ = c;
            // ncclResult_t ncclGetVersion(int*), declared here because this file builds without nccl.h: NCCL's C
            // enum comes back as an int, ncclSuccess is 0.
            using GetVersion = int (*)(int*);
            if (auto get_version = reinterpret_cast<GetVersion>(symbol("ncclGetVersion"))) {
                int v = 0;
                if (get_version(&v) == 0) version_ = v;
            }
            return;
        }
        // dlerror's text usually starts with the file's name already.
        const char* why = dlerror();
        const std::string text = why != nullptr ? why : "not loadable";
        tried_ += (tried_.empty() ? "" : "; ") + (text.rfind(c, 0) == 0 ? text : c + ": " + text);
    }
}

std::string NcclLibrary::failure(const std::string& advice) const {
    return std::string(kNcclLibrary) + " could not be loaded (tried " + (tried_.empty() ? "nothing" : tried_) + advice +
           ")";
}

void* NcclLibrary::symbol(const char* name) const { return handle_ != nullptr ? dlsym(handle_, name) : nullptr; }

}  // namespace weft::detail
