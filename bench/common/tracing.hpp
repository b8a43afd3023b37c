// SPDX-License-Identifier: MIT
// The benchmarks' intra-kernel trace options: --trace PATH (trace every World of the run, as WEFT_TRACE=PATH does)
// and --trace-overhead (time every figure untraced, then traced, in one run; the table shows both).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "common/cli.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/trace.hpp"
#include "weft/runtime/world.hpp"

namespace weft::bench {

struct TraceOptions {
    std::string path;       ///< where the traced Worlds write their trace ("": WEFT_TRACE's value, if any)
    bool overhead = false;  ///< time untraced, then traced
};

/// Registers --trace and --trace-overhead.
inline void add_trace_options(Cli& cli, TraceOptions* out) {
    cli.option("--trace", "PATH",
               "record the intra-kernel trace of every World into PATH (as WEFT_TRACE=PATH; the file holds the last "
               "figure measured: run one shape to trace it)",
               [out](const std::string& v) {
                   if (v.empty()) throw UsageError("--trace: expected a file path");
                   out->path = v;
               });
    cli.flag("--trace-overhead",
             "time every figure untraced, then traced (WEFT_TRACE; the trace goes to --trace, else to a file in the "
             "temporary folder) and show both",
             &out->overhead);
}

/// The file the traced pass writes: --trace, else WEFT_TRACE, else `<temp>/<bench>_trace.json` with
/// --trace-overhead; "" when nothing is traced.
inline std::string traced_pass_path(const TraceOptions& o, const std::string& bench) {
    if (!o.path.empty()) return o.path;
    if (const auto env = trace_path_from_env()) return *env;
    if (!o.overhead) return "";
    return (std::filesystem::temp_directory_path() / (bench + "_trace.json")).string();
}

/// Sets WEFT_TRACE to `path` (or unsets it when empty) for the Worlds and kernels made from now on. Call it from the
/// main thread while no rank thread runs: the JIT reads the variable at every compile, the World when it is made.
inline void set_trace_env(const std::string& path) {
    if (path.empty()) {
        ::unsetenv("WEFT_TRACE");
    } else {
        ::setenv("WEFT_TRACE", path.c_str(), 1);
    }
}

/// Empties this rank's trace buffer before a measurement (collective: every rank calls it with its streams drained;
/// host barriers keep any rank from launching while another synchronises its device). No-op when `w` does not trace.
inline void start_traced_measurement(World& w) {
    if (!tracing(w)) return;
    w.barrier();
    (void)discard_trace(w);
    w.barrier();
}

/// Events this rank's kernels tried to record since start_traced_measurement (collective, as it); 0 untraced.
inline uint64_t traced_events(World& w) {
    if (!tracing(w)) return 0;
    w.barrier();
    const uint64_t n = trace_event_count(w);
    w.barrier();
    return n;
}

}  // namespace weft::bench
