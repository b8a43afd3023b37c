// SPDX-License-Identifier: MIT
// weftrun's command line (options.hpp).
#include "options.hpp"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace weft::weftrun {
namespace {

constexpr int kUsageError = 2;

const char* kUsage =
    "usage: weftrun -n N [--gpus LIST] [--timeout S] [--port P] [--grace S] [--] prog [args...]\n"
    "\n"
    "Starts N processes of prog on this host, each with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,\n"
    "MASTER_ADDR=127.0.0.1, MASTER_PORT, WEFT_RUN_ID and WEFT_JOB_TOKEN set, and prefixes their output with\n"
    "\"[rank K] \".\n"
    "\n"
    "  -n, --nproc N   number of ranks (1..4096)\n"
    "  --gpus LIST     comma-separated CUDA devices; rank i gets CUDA_VISIBLE_DEVICES=LIST[i % len]\n"
    "                  (indices count within an inherited CUDA_VISIBLE_DEVICES; UUIDs pass as they are;\n"
    "                  without it CUDA_VISIBLE_DEVICES is left as it is; LOCAL_RANK stays the rank, so a\n"
    "                  rank selects device LOCAL_RANK % visible devices, as weft does, or device 0)\n"
    "  --timeout S     stop every rank after S seconds (exit 124); default: no limit\n"
    "  --port P        MASTER_PORT to set (for torch.distributed; weft meets elsewhere); default: a free port\n"
    "  --grace S       seconds between SIGTERM and SIGKILL when stopping ranks; default 5\n"
    "  -h, --help      this text\n"
    "\n"
    "When a rank exits non-zero or dies by a signal, the others get SIGTERM (then SIGKILL after the grace\n"
    "period) and weftrun exits with that rank's code (128+signal for a signal, 127/126 when prog cannot be\n"
    "executed, 1 when a rank could not be started); on a failure the process group of every rank that was\n"
    "still running (or had its output open) gets SIGKILL before weftrun exits. SIGINT, SIGTERM and SIGHUP\n"
    "are forwarded to every rank (a second one sends SIGKILL); weftrun then exits with 128+signal. A signal\n"
    "weftrun was started with ignored (nohup, a background job) stays ignored, in the ranks too. Ranks that\n"
    "outlive SIGKILL by 10 s are named and left behind. weftrun raises its own open-file limit (the ranks get\n"
    "the original) and refuses a job (exit 1) when even the raised limit is below about 2N + 32 files.\n"
    "Launcher variables it inherits (TORCHELASTIC_*, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_*) are not passed\n"
    "on. A reader of weftrun's output that stops reading holds up the ranks' writes, not the timeout or the\n"
    "signals; weftrun exits once everything is written, or, at a signal after the ranks are gone (or a\n"
    "second one), stops reading their output and ends by that signal if the reader still takes nothing.\n";

[[noreturn]] void usage_error(const std::string& message) {
    std::fprintf(stderr,
                 "weftrun: %s\nusage: weftrun -n N [--gpus LIST] [--timeout S] [--port P] [--grace S] [--] prog "
                 "[args...]\n(weftrun --help explains each option)\n",
                 message.c_str());
    std::exit(kUsageError);
}

long parse_long(const std::string& text, const char* what, long lo, long hi) {
    char* end = nullptr;
    errno = 0;
    long v = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno != 0 || v < lo || v > hi ||
        std::isspace(static_cast<unsigned char>(text[0]))) {
        usage_error(std::string(what) + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                    "], got '" + text + "'");
    }
    return v;
}

double parse_seconds(const std::string& text, const char* what, bool allow_zero) {
    char* end = nullptr;
    errno = 0;
    double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || errno != 0 || !std::isfinite(v) || v < 0 || (!allow_zero && v == 0) ||
        v > 1e7) {
        usage_error(std::string(what) + " must be a number of seconds" + (allow_zero ? " >= 0" : " > 0") + ", got '" +
                    text + "'");
    }
    return v;
}

// "a,b,c" as {"a", "b", "c"} (empty items kept, for the caller to refuse).
std::vector<std::string> split_commas(const std::string& text) {
    std::vector<std::string> items;
    size_t start = 0;
    while (true) {
        const size_t comma = text.find(',', start);
        items.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
        if (comma == std::string::npos) return items;
        start = comma + 1;
    }
}

}  // namespace

Options parse_args(int argc, char** argv) {
    Options o;
    bool have_n = false;
    int i = 1;
    // "--name value", "--name=value" and, for -n, "-nVALUE".
    auto value_of = [&](const std::string& arg, const std::string& name, std::string* value) {
        if (arg == name) {
            if (i + 1 >= argc) usage_error(name + " needs a value");
            *value = argv[++i];
            return true;
        }
        if (arg.rfind(name + "=", 0) == 0) {
            *value = arg.substr(name.size() + 1);
            return true;
        }
        return false;
    };
    for (; i < argc; ++i) {
        std::string arg = argv[i];
        std::string value;
        if (arg == "--") {
            ++i;
            break;
        }
        if (arg == "-h" || arg == "--help") {
            std::fputs(kUsage, stdout);
            std::exit(0);
        }
        if (value_of(arg, "-n", &value) || value_of(arg, "--nproc", &value) ||
            (arg.size() > 2 && arg.rfind("-n", 0) == 0 && arg[2] != '-' && (value = arg.substr(2), true))) {
            o.num_ranks = static_cast<int>(parse_long(value, "-n", 1, 4096));
            have_n = true;
        } else if (value_of(arg, "--gpus", &value)) {
            o.gpus = split_commas(value);
            for (const std::string& item : o.gpus) {
                if (item.empty() || item[0] == '-' || item.find_first_of(" \t") != std::string::npos) {
                    usage_error("--gpus must be a comma-separated list of devices such as 0,1,2, got '" + value + "'");
                }
            }
            // Indices count within an inherited CUDA_VISIBLE_DEVICES (an allocation's GPUs), as CUDA's own would.
            if (const char* inherited = std::getenv("CUDA_VISIBLE_DEVICES"); inherited != nullptr && *inherited) {
                const std::vector<std::string> visible = split_commas(inherited);
                for (std::string& item : o.gpus) {
                    if (item.find_first_not_of("0123456789") != std::string::npos) continue;  // a UUID or MIG name
                    const auto index = static_cast<size_t>(parse_long(item, "--gpus", 0, 1L << 20));
                    if (index >= visible.size()) {
                        usage_error("--gpus " + item + ": CUDA_VISIBLE_DEVICES='" + std::string(inherited) +
                                    "' (inherited) has " + std::to_string(visible.size()) +
                                    " devices; --gpus indices count within it");
                    }
                    item = visible[index];
                }
            }
        } else if (value_of(arg, "--timeout", &value)) {
            o.timeout_s = parse_seconds(value, "--timeout", true);
        } else if (value_of(arg, "--port", &value)) {
            o.port = static_cast<int>(parse_long(value, "--port", 1, 65535));
        } else if (value_of(arg, "--grace", &value)) {
            o.grace_s = parse_seconds(value, "--grace", true);
        } else if (!arg.empty() && arg[0] == '-') {
            usage_error("unknown option '" + arg + "' (put the program after --)");
        } else {
            break;  // the program starts here
        }
    }
    for (; i < argc; ++i) o.command.emplace_back(argv[i]);
    if (!have_n) usage_error("-n N (the number of ranks) is required");
    if (o.command.empty()) usage_error("no program given (weftrun -n N -- prog args...)");
    return o;
}

}  // namespace weft::weftrun
