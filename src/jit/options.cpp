// SPDX-License-Identifier: MIT
// CompileOptions: canonical text for the cache key, and the WEFT_JIT_* overrides.
#include "weft/jit/options.hpp"

#include <sstream>

#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"

namespace weft::jit {

namespace {
void append_list(std::ostringstream& os, const char* name, const std::vector<std::string>& items) {
    os << name << '[' << items.size() << ']';
    for (const auto& item : items) os << ' ' << item.size() << ':' << item;
    os << '\n';
}
}  // namespace

std::string CompileOptions::canonical() const {
    std::ostringstream os;
    os << "lineinfo=" << lineinfo << "\nlto=" << lto << "\nmax_registers=" << max_registers << '\n';
    append_list(os, "defines", defines);
    // Link files enter the key by content (the compiler hashes each one), not by path, so that a
    // cache stays valid when the tree moves.
    os << "link_files=" << link_files.size() << '\n';
    append_list(os, "extra_flags", extra_flags);
    return os.str();
}

void CompileOptions::check() const {
    for (const std::string& f : extra_flags) {
        const bool includes = f.rfind("-I", 0) == 0 || f.rfind("--include-path", 0) == 0 ||
                              f.rfind("-include", 0) == 0 || f.rfind("--pre-include", 0) == 0 ||
                              f.rfind("-isystem", 0) == 0;
        WEFT_CHECK(!includes,
                   "CompileOptions::extra_flags: '"
                       << f
                       << "' names headers the kernel cache's key does not hash (an edit to them would "
                          "reuse a stale cubin); give include folders as CompilerConfig::extra_include_roots "
                          "(or FusedGemmSpec::include_root) and include the headers from the kernel's own");
    }
}

std::string CompileOptions::describe() const {
    std::ostringstream os;
    os << (lto ? "-dlto" : "(no LTO)");
    if (lineinfo) os << " -lineinfo";
    if (max_registers > 0) os << " --maxrregcount=" << max_registers;
    for (const auto& d : defines) os << " -D" << d;
    for (const auto& f : extra_flags) os << ' ' << f;
    for (const auto& l : link_files) os << " link:" << l;
    return os.str();
}

CompileOptions apply_env_options(CompileOptions base) {
    if (auto v = env::get_bool("WEFT_JIT_LINEINFO")) base.lineinfo = *v;
    if (auto v = env::get_bool("WEFT_JIT_LTO")) base.lto = *v;
    if (auto v = env::get_bool("WEFT_JIT_VERBOSE_PTXAS")) base.verbose_ptxas = *v;
    if (auto v = env::get_int("WEFT_JIT_MAXRREGCOUNT")) {
        WEFT_CHECK(*v >= 0 && *v <= 255, "WEFT_JIT_MAXRREGCOUNT must be in 0..255 (0 = no limit), got " << *v);
        base.max_registers = static_cast<int>(*v);
    }
    if (auto v = env::get("WEFT_JIT_DUMP_DIR")) base.dump_dir = *v;
    // The intra-kernel trace (weft/device/trace.cuh): kernels record only when compiled with it.
    if (auto v = env::get("WEFT_TRACE"); v && !v->empty()) base.defines.push_back("WEFT_TRACE=1");
    return base;
}

}  // namespace weft::jit
