// SPDX-License-Identifier: MIT
// Where the JIT finds weft's headers, the CUDA toolkit's headers and its cache, at run time.
//
// Searches start from where the program and the library are; the one path baked in at build time, the install
// prefix, comes last and is rewritten by `cmake --install` (weft/detail/install_prefix.hpp).
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace weft::jit {

/// The include roots NVRTC searches, in order: `extra` (tests, user kernels), weft's `include/`,
/// weft's `kernels/`, then the toolkit's directories.
struct IncludeRoots {
    std::vector<std::filesystem::path> extra;       ///< searched first; may shadow weft's headers
    std::filesystem::path weft_include;             ///< contains weft/device/token.cuh
    std::filesystem::path weft_kernels;             ///< contains one folder per kernel family
    std::vector<std::filesystem::path> cuda;        ///< toolkit include dir (+ its cccl/ subfolder)
    std::string found_by;                           ///< how weft's roots were found (for logs)

    /// weft's roots in search order: extra, weft_include, weft_kernels (the ones whose headers are
    /// hashed into the cache key).
    std::vector<std::filesystem::path> weft_roots() const;
};

/// Finds weft's roots: WEFT_HOME (a directory holding include/ and kernels/, or an install prefix
/// holding include/ and share/weft/kernels) when set; else search_include_roots() from the running
/// executable's folder and the library's own file's folder, then the install prefix compiled into weft.
/// Throws weft::Error listing every place searched when none matches.
IncludeRoots find_include_roots();

/// The digest of the headers `names` (in name order) under `weft_include`/weft/common (the structs the library and
/// the JIT's kernels share): SHA-256 of one line "name:sha256-of-its-bytes\n" per header, as
/// cmake/weft_headers_digest.cmake computes it at build time. Throws weft::Error naming a header that is missing.
std::string common_headers_digest(const std::filesystem::path& weft_include, const std::vector<std::string>& names);
/// Throws weft::Error unless the headers of include/weft/common this library was built from are in roots.weft_include
/// with the same contents (kernels compiled from other headers would disagree with it on its parameter structs: an
/// older install, a source tree of another version found upward from the executable); other files there are not
/// looked at. The Compiler checks the roots it finds itself.
void check_headers_match_library(const IncludeRoots& roots);

/// The search behind find_include_roots() without WEFT_HOME: the nearest ancestor of each of `starts`, in
/// order, that holds a source tree or an install layout; else `install_prefix` itself (not its ancestors;
/// skipped when empty). A tree for which `reject` returns a reason is passed over (find_include_roots: headers
/// that are not this library's). Throws weft::Error listing every place searched when none matches, or every
/// tree passed over, with its reason, when trees were found but none accepted.
IncludeRoots search_include_roots(const std::vector<std::filesystem::path>& starts,
                                  const std::filesystem::path& install_prefix,
                                  const std::function<std::optional<std::string>(const IncludeRoots&)>& reject = {});

/// The weft roots under `dir` if it is a source tree (include/weft/device/token.cuh and kernels/) or
/// an install prefix (include/weft/device/token.cuh and share/weft/kernels/); nullopt otherwise.
std::optional<IncludeRoots> weft_roots_at(const std::filesystem::path& dir);

/// The toolkit include directories NVRTC needs: CUDA_HOME or CUDA_PATH when set; else derived from
/// the location of the loaded libnvrtc; else /usr/local/cuda. The first directory holding
/// cuda_fp16.h wins; its cccl/ subfolder (CUDA 13 keeps libcu++ there) is added when present.
/// Throws weft::Error listing every place searched when none matches.
std::vector<std::filesystem::path> find_cuda_include_dirs();

/// A hex SHA-256 that tells toolkit headers apart: the names and contents of the version-bearing headers found in
/// `cuda_dirs` (cuda.h, cuda_fp16.hpp, cuda_bf16.hpp, cuda_fp8.hpp and CCCL's cuda/std/__cccl/version.h, in the
/// first directory that holds each). Paths do not enter it: the same toolkit elsewhere gives the same digest.
/// Part of the JIT cache key, so kernels compiled against one toolkit's headers are not reused with another's.
std::string toolkit_headers_digest(const std::vector<std::filesystem::path>& cuda_dirs);

/// WEFT_CACHE_DIR, else $XDG_CACHE_HOME/weft, else $HOME/.cache/weft; nullopt when none is set.
std::optional<std::filesystem::path> default_cache_dir();

}  // namespace weft::jit
