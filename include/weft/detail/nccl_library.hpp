// SPDX-License-Identifier: MIT
// libnccl, opened at run time (dlopen) once per process for every part of weft that calls NCCL: the host-API network
// backend, the GIN backend and the benchmarks' NCCL baseline. No nccl.h here: callers resolve typed entry points.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace weft::detail {

/// Where the process's NCCL is looked for, before python3 is asked (NcclLibrary::process()).
struct NcclSearch {
    std::optional<std::string> weft_nccl_library;  ///< WEFT_NCCL_LIBRARY
    std::optional<std::string> cuda_home;          ///< CUDA_HOME
    std::optional<std::string> cuda_path;          ///< CUDA_PATH
    /// The three variables of this process's environment.
    static NcclSearch from_environment();
};

/// The files to try, in order: WEFT_NCCL_LIBRARY alone when it is set and not empty (the user said which); else
/// libnccl.so.2 on the loader's path, then $CUDA_HOME/lib/, $CUDA_HOME/lib64/, $CUDA_PATH/lib/, $CUDA_PATH/lib64/,
/// /usr/local/cuda/lib/ and /usr/local/cuda/lib64/ (libnccl.so.2 in each; empty variables skipped, repeats dropped).
std::vector<std::string> nccl_library_candidates(const NcclSearch& search);

/// The files to try in python3's nvidia.nccl package folder `dir`: <dir>/lib/libnccl.so.2, <dir>/libnccl.so.2
/// (none for an empty `dir`).
std::vector<std::string> nccl_python_candidates(const std::string& dir);

/// A libnccl opened with dlopen (RTLD_NOW | RTLD_LOCAL), or why none could be. Holds no NCCL types: each user
/// resolves the entry points it calls, typed with nccl.h's declarations, through resolve().
class NcclLibrary {
public:
    /// The process's NCCL, opened on the first call (thread-safe; a program that never calls this never opens
    /// libnccl) and never closed: the first of nccl_library_candidates(NcclSearch::from_environment()) that dlopen
    /// accepts; when none does and WEFT_NCCL_LIBRARY is not set, the first of nccl_python_candidates() of python3's
    /// nvidia.nccl package (python3 is run only then). Every user shares it, so a process never holds two NCCLs.
    static const NcclLibrary& process();

    /// Opens the first of `candidates` that dlopen accepts, for tests and diagnostics; closes it when destroyed.
    explicit NcclLibrary(const std::vector<std::string>& candidates);
    ~NcclLibrary();
    NcclLibrary(const NcclLibrary&) = delete;
    NcclLibrary& operator=(const NcclLibrary&) = delete;

    bool loaded() const { return handle_ != nullptr; }
    /// The file that opened, as named among the candidates; empty when none did.
    const std::string& path() const { return path_; }
    /// ncclGetVersion's code (22809 for 2.28.9); 0 when nothing opened or the library has no ncclGetVersion.
    int version() const { return version_; }
    /// Empty when loaded; else "libnccl.so.2 could not be loaded (tried <file>: <dlerror's text>; ...)", from
    /// process() followed by what to set ("; set WEFT_NCCL_LIBRARY to its path", or that only it was tried).
    const std::string& why_not() const { return why_not_; }

    /// The entry point `name` (dlsym), or nullptr when the library lacks it or nothing opened.
    void* symbol(const char* name) const;
    /// Sets `fn` to the entry point `name`; when the library lacks it, `fn` is nullptr and `name` is appended to
    /// `missing` (", " between names).
    template <class Fn>
    void resolve(Fn*& fn, const char* name, std::string& missing) const {
        fn = reinterpret_cast<Fn*>(symbol(name));
        if (fn == nullptr) missing += (missing.empty() ? "" : ", ") + std::string(name);
    }

private:
    NcclLibrary() = default;
    /// Tries `candidates` in order until one opens; records each failure (file and dlerror's text) in tried_.
    void open_first(const std::vector<std::string>& candidates);
    /// why_not()'s sentence: the files tried, then `advice`.
    std::string failure(const std::string& advice) const;

    void* handle_ = nullptr;
    std::string path_;
    int version_ = 0;
    std::string tried_;  ///< "<file>: <dlerror's text>" of each candidate that did not open, "; " between them
    std::string why_not_;
};

}  // namespace weft::detail
