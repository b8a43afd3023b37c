// SPDX-License-Identifier: MIT
// The benchmarks' command line (cli.hpp).
#include "common/cli.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <sstream>
#include <utility>

namespace weft::bench {
namespace {

[[noreturn]] void usage_error(const std::string& option, const std::string& what) {
    throw UsageError(option + ": " + what);
}

std::string quoted(const std::string& s) { return "'" + s + "'"; }

std::string join(const std::vector<std::string>& items, const char* sep) {
    std::string out;
    for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
    return out;
}

std::vector<std::string> dtype_names(const std::vector<DType>& types) {
    std::vector<std::string> names;
    for (DType t : types) names.emplace_back(dtype_name(t));
    return names;
}

// A non-negative decimal integer that fits in uint64_t, or nothing.
bool parse_digits(const std::string& s, uint64_t* out) {
    if (s.empty() || !std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; })) {
        return false;
    }
    errno = 0;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
    if (errno != 0 || *end != '\0') return false;
    *out = v;
    return true;
}

template <size_t N>
std::vector<std::array<int64_t, N>> parse_shapes(const std::string& text, const std::string& option, const char* form) {
    std::vector<std::array<int64_t, N>> shapes;
    for (const std::string& item : split(text, ',')) {
        std::array<int64_t, N> s{};
        std::string rest = item + "x";
        size_t at = 0;
        for (size_t d = 0; d < N; ++d) {
            const size_t x = rest.find('x', at);
            uint64_t v = 0;
            if (x == std::string::npos || !parse_digits(rest.substr(at, x - at), &v) || v < 1 ||
                v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
                usage_error(option, std::string("expected ") + form + " with every extent >= 1, got " + quoted(item));
            }
            s[d] = static_cast<int64_t>(v);
            at = x + 1;
        }
        if (at != rest.size()) {
            usage_error(option, std::string("expected ") + form + " with every extent >= 1, got " + quoted(item));
        }
        shapes.push_back(s);
    }
    if (shapes.empty()) usage_error(option, std::string("expected ") + form + "[,...], got " + quoted(text));
    return shapes;
}

}  // namespace

Cli::Cli(std::string program, std::string summary) : program_(std::move(program)), summary_(std::move(summary)) {}

Cli& Cli::add(Option o) {
    for (const Option& x : options_) {
        if (x.name == o.name) throw std::logic_error("Cli: option " + o.name + " registered twice");
    }
    options_.push_back(std::move(o));
    return *this;
}

Cli& Cli::sizes(const std::string& metavar, const std::string& help, Setter set) {
    return option("--sizes", metavar, help, std::move(set));
}

Cli& Cli::iters(int* out) { return int_option("--iters", "timed iterations", out, 1, std::numeric_limits<int>::max()); }

Cli& Cli::warmup(int* out) {
    return int_option("--warmup", "untimed iterations before the timed ones", out, 0, std::numeric_limits<int>::max());
}

Cli& Cli::dtype(DType* out, std::vector<DType> allowed) {
    const std::string names = join(dtype_names(allowed), "|");
    return option("--dtype", names, std::string("element type (default ") + dtype_name(*out) + ")",
                  [out, allowed](const std::string& v) { *out = parse_dtype(v, "--dtype", allowed); });
}

Cli& Cli::world(std::vector<int>* out, int lo, int hi) {
    std::vector<std::string> defaults;
    for (int w : *out) defaults.push_back(std::to_string(w));
    return option("--world", "N[,N...]", "world sizes, ranks as threads (default " + join(defaults, ",") + ")",
                  [out, lo, hi](const std::string& v) {
                      out->clear();
                      for (int64_t w : parse_int_list(v, "--world", lo, hi)) out->push_back(static_cast<int>(w));
                  });
}

Cli& Cli::world(int* out, int lo, int hi, const std::string& help) {
    return option("--world", "N", help,
                  [out, lo, hi](const std::string& v) { *out = static_cast<int>(parse_int(v, "--world", lo, hi)); });
}

Cli& Cli::check(bool* out) { return flag("--check", "verify the results against a reference", out); }

Cli& Cli::json(std::string* out) {
    return option("--json", "FILE", "write every row as JSON to FILE", [out](const std::string& v) {
        if (v.empty()) usage_error("--json", "expected a file name");
        *out = v;
    });
}

Cli& Cli::placement(Placement* out) {
    return option("--placement", "shared|spread",
                  std::string("shared: every rank on GPU 0; spread: rank r on visible GPU r % GPUs (default ") +
                      placement_name(*out) + ")",
                  [out](const std::string& v) {
                      *out = parse_choice(v, "--placement", {"shared", "spread"}) == "spread" ? Placement::kSpread
                                                                                              : Placement::kShared;
                  });
}

Cli& Cli::flag(const std::string& name, const std::string& help, bool* out) {
    Option o;
    o.name = name;
    o.help = help;
    o.flag = out;
    return add(std::move(o));
}

Cli& Cli::option(const std::string& name, const std::string& metavar, const std::string& help, Setter set) {
    Option o;
    o.name = name;
    o.metavar = metavar;
    o.help = help;
    o.set = std::move(set);
    return add(std::move(o));
}

Cli& Cli::int_option(const std::string& name, const std::string& help, int* out, int lo, int hi) {
    std::string range = hi == std::numeric_limits<int>::max() ? ">= " + std::to_string(lo)
                                                              : std::to_string(lo) + ".." + std::to_string(hi);
    return option(name, "N", help + " (" + range + ", default " + std::to_string(*out) + ")",
                  [out, name, lo, hi](const std::string& v) { *out = static_cast<int>(parse_int(v, name, lo, hi)); });
}

void Cli::parse(int argc, const char* const* argv) {
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--help" || arg == "-h") {
            std::fputs(usage().c_str(), stdout);
            std::exit(0);
        }
        const auto it = std::find_if(options_.begin(), options_.end(), [&](const Option& o) { return o.name == arg; });
        if (it == options_.end()) throw UsageError("unknown option " + quoted(arg));
        if (it->flag != nullptr) {
            *it->flag = true;
            continue;
        }
        if (i + 1 >= argc) usage_error(arg, "needs a value (" + it->metavar + ")");
        it->set(argv[++i]);
    }
}

std::string Cli::usage() const {
    std::ostringstream os;
    os << "usage: " << program_ << " [options]\n" << summary_ << "\n\n";
    std::vector<std::pair<std::string, std::string>> rows;
    for (const Option& o : options_) rows.emplace_back(o.flag != nullptr ? o.name : o.name + " " + o.metavar, o.help);
    rows.emplace_back("--help", "this text");
    size_t width = 0;
    for (const auto& [head, help] : rows) width = std::max(width, head.size());
    for (const auto& [head, help] : rows)
        os << "  " << head << std::string(width + 2 - head.size(), ' ') << help << "\n";
    return os.str();
}

const char* placement_name(Placement p) { return p == Placement::kSpread ? "spread" : "shared"; }

void check_placement(Placement p, int num_devices) {
    if (p == Placement::kSpread && num_devices < 2) {
        throw UsageError("--placement spread needs at least 2 visible GPUs, found " + std::to_string(num_devices));
    }
}

int64_t parse_int(const std::string& text, const std::string& option, int64_t lo, int64_t hi) {
    const std::string range = std::to_string(lo) + ".." + std::to_string(hi);
    const bool negative = !text.empty() && text[0] == '-';
    uint64_t magnitude = 0;
    if (!parse_digits(negative ? text.substr(1) : text, &magnitude) ||
        magnitude > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        usage_error(option, "expected an integer in " + range + ", got " + quoted(text));
    }
    const int64_t v = negative ? -static_cast<int64_t>(magnitude) : static_cast<int64_t>(magnitude);
    if (v < lo || v > hi) usage_error(option, "expected an integer in " + range + ", got " + quoted(text));
    return v;
}

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& option, int64_t lo, int64_t hi) {
    std::vector<int64_t> values;
    for (const std::string& item : split(text, ',')) values.push_back(parse_int(item, option, lo, hi));
    if (values.empty()) usage_error(option, "expected a comma-separated list of integers, got " + quoted(text));
    return values;
}

uint64_t parse_bytes(const std::string& text, const std::string& option) {
    std::string digits = text;
    uint64_t scale = 1;
    if (!digits.empty()) {
        const char suffix = static_cast<char>(std::toupper(static_cast<unsigned char>(digits.back())));
        const int shift = suffix == 'K' ? 10 : suffix == 'M' ? 20 : suffix == 'G' ? 30 : suffix == 'T' ? 40 : 0;
        if (shift != 0) {
            digits.pop_back();
            scale = uint64_t{1} << shift;
        }
    }
    uint64_t v = 0;
    if (!parse_digits(digits, &v) || v > std::numeric_limits<uint64_t>::max() / scale) {
        usage_error(option, "expected a byte size such as 4096, 64K, 512M or 2G, got " + quoted(text));
    }
    return v * scale;
}

std::vector<uint64_t> parse_byte_sizes(const std::string& text, const std::string& option) {
    std::vector<uint64_t> sizes;
    if (text.find(':') != std::string::npos) {
        const std::vector<std::string> parts = split(text, ':');
        if (parts.size() != 2 && parts.size() != 3) usage_error(option, "expected A:B or A:B:F, got " + quoted(text));
        const uint64_t lo = parse_bytes(parts[0], option), hi = parse_bytes(parts[1], option);
        const uint64_t factor = parts.size() == 3 ? parse_bytes(parts[2], option) : 4;
        if (lo < 1 || lo > hi || factor < 2) {
            usage_error(option, "A:B[:F] needs 1 <= A <= B and F >= 2, got " + quoted(text));
        }
        for (uint64_t s = lo; s <= hi; s *= factor) {
            sizes.push_back(s);
            if (s > std::numeric_limits<uint64_t>::max() / factor) break;
        }
    } else {
        for (const std::string& item : split(text, ',')) {
            const uint64_t s = parse_bytes(item, option);
            if (s < 1) usage_error(option, "sizes must be >= 1 byte, got " + quoted(item));
            sizes.push_back(s);
        }
    }
    if (sizes.empty()) usage_error(option, "expected sizes such as 4K,1M or 1K:1G, got " + quoted(text));
    return sizes;
}

std::vector<std::array<int64_t, 3>> parse_shapes3(const std::string& text, const std::string& option) {
    return parse_shapes<3>(text, option, "MxNxK");
}

std::vector<std::array<int64_t, 2>> parse_shapes2(const std::string& text, const std::string& option) {
    return parse_shapes<2>(text, option, "AxB");
}

std::string parse_choice(const std::string& text, const std::string& option, const std::vector<std::string>& allowed) {
    if (std::find(allowed.begin(), allowed.end(), text) == allowed.end()) {
        usage_error(option, "expected one of " + join(allowed, ", ") + "; got " + quoted(text));
    }
    return text;
}

std::vector<std::string> parse_choice_list(const std::string& text, const std::string& option,
                                           const std::vector<std::string>& allowed) {
    std::vector<std::string> picked;
    for (const std::string& item : split(text, ',')) picked.push_back(parse_choice(item, option, allowed));
    if (picked.empty()) usage_error(option, "expected a comma-separated list of " + join(allowed, ", "));
    return picked;
}

DType parse_dtype(const std::string& text, const std::string& option, const std::vector<DType>& allowed) {
    for (DType t : allowed) {
        if (text == dtype_name(t)) return t;
    }
    usage_error(option, "expected one of " + join(dtype_names(allowed), ", ") + "; got " + quoted(text));
}

std::vector<std::array<int64_t, 2>> parse_head_pairs(const std::string& text, const std::string& option,
                                                     int64_t max_group) {
    std::vector<std::array<int64_t, 2>> pairs;
    for (const std::string& item : split(text, ',')) {
        const size_t slash = item.find('/');
        if (slash == std::string::npos) usage_error(option, "expected Q/KV, got " + quoted(item));
        const int64_t q = parse_int(item.substr(0, slash), option, 1, 4096);
        const int64_t kv = parse_int(item.substr(slash + 1), option, 1, 4096);
        if (q % kv != 0 || q / kv > max_group) {
            usage_error(option, "Q must be a multiple of KV with Q / KV <= " + std::to_string(max_group) + ", got " +
                                    quoted(item));
        }
        pairs.push_back({q, kv});
    }
    if (pairs.empty()) usage_error(option, "expected Q/KV[,Q/KV...], got " + quoted(text));
    return pairs;
}

std::vector<std::string> split(const std::string& text, char sep) {
    std::vector<std::string> out;
    std::string item;
    std::istringstream ss(text);
    while (std::getline(ss, item, sep)) {
        if (!item.empty()) out.push_back(item);
    }
    return out;
}

int run_main(const char* program, const std::function<int()>& body) {
    try {
        return body();
    } catch (const UsageError& e) {
        std::fprintf(stderr, "%s: %s (see --help)\n", program, e.what());
        return 2;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: %s\n", program, e.what());
        return 1;
    }
}

}  // namespace weft::bench
