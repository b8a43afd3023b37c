// SPDX-License-Identifier: MIT
// Compile options of the JIT and the WEFT_JIT_* environment variables that override them.
#pragma once

#include <string>
#include <vector>

namespace weft::jit {

/// How one kernel specialisation is compiled. Every field except `dump_dir` and `verbose_ptxas`
/// changes the generated code and is therefore part of the cache key.
struct CompileOptions {
    bool lineinfo = false;       ///< -lineinfo: source lines in the cubin (profilers, sanitizer)
    bool lto = false;            ///< NVRTC emits LTO-IR and nvJitLink links it (-dlto / -lto)
    int max_registers = 0;       ///< --maxrregcount; 0 leaves the choice to ptxas
    std::vector<std::string> defines;     ///< "NAME" or "NAME=VALUE", passed as -D
    std::vector<std::string> link_files;  ///< device libraries (.a .cubin .fatbin .ltoir .ptx) that
                                          ///< nvJitLink links in; non-empty forces the link step
    /// Further NVRTC flags, verbatim (part of the key, as text). Not include paths or pre-included headers (-I,
    /// --include-path, -isystem, -include, --pre-include): the key hashes the headers under the compiler's include
    /// roots (CompilerConfig::extra_include_roots), not what a flag names, so an edit there would reuse a stale cubin.
    std::vector<std::string> extra_flags;
    bool verbose_ptxas = false;  ///< log ptxas' register/spill report at info level (it is always
                                 ///< captured into CompileResult::ptxas_info)
    std::string dump_dir;        ///< when set, write .cu, .ptx, .cubin and .log files here

    /// True when nvJitLink must run after NVRTC (LTO or device libraries).
    bool needs_link() const { return lto || !link_files.empty(); }

    /// Canonical text of every key-relevant field (link files by name; their content is hashed
    /// separately by the compiler).
    std::string canonical() const;
    /// Throws weft::Error naming the flag when extra_flags holds an include path or a pre-included header.
    void check() const;
    /// Every field as NVRTC flags would show it, for error messages: "-lineinfo -DX=1 --maxrregcount=64 ...".
    std::string describe() const;
};

/// Returns `base` with every WEFT_JIT_* variable that is set applied on top (a set variable wins):
/// WEFT_JIT_LINEINFO, WEFT_JIT_LTO, WEFT_JIT_MAXRREGCOUNT, WEFT_JIT_VERBOSE_PTXAS, WEFT_JIT_DUMP_DIR.
/// A malformed value is a weft::Error naming the variable.
CompileOptions apply_env_options(CompileOptions base);

}  // namespace weft::jit
