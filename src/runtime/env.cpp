// SPDX-License-Identifier: MIT
// Typed environment reads.
#include "weft/runtime/env.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "weft/runtime/error.hpp"

namespace weft::env {

std::optional<std::string> get(const char* name) {
    const char* value = std::getenv(name);
    if (value == nullptr) return std::nullopt;
    return std::string(value);
}

int64_t parse_int(const std::string& text, const char* what) {
    const char* begin = text.c_str();
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(begin, &end, 10);
    bool ok = !text.empty() && errno == 0 && end != begin && *end == '\0' && !std::isspace(static_cast<unsigned char>(text[0]));
    WEFT_CHECK(ok, what << " must be an integer, got '" << text << "'");
    return static_cast<int64_t>(v);
}

uint64_t parse_bytes(const std::string& text, const char* what) {
    WEFT_CHECK(!text.empty(), what << " must be a byte size such as 4096, 512M or 2G, got ''");
    std::string digits = text;
    uint64_t scale = 1;
    char suffix = static_cast<char>(std::toupper(static_cast<unsigned char>(text.back())));
    if (suffix == 'K' || suffix == 'M' || suffix == 'G' || suffix == 'T') {
        digits.pop_back();
        scale = suffix == 'K' ? (1ull << 10) : suffix == 'M' ? (1ull << 20) : suffix == 'G' ? (1ull << 30) : (1ull << 40);
    }
    bool all_digits = !digits.empty() && std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); });
    WEFT_CHECK(all_digits, what << " must be a byte size such as 4096, 512M or 2G, got '" << text << "'");
    errno = 0;
    unsigned long long v = std::strtoull(digits.c_str(), nullptr, 10);
    WEFT_CHECK(errno == 0 && v <= std::numeric_limits<uint64_t>::max() / scale,
               what << " is too large: '" << text << "'");
    return static_cast<uint64_t>(v) * scale;
}

bool parse_bool(const std::string& text, const char* what) {
    std::string v = text;
    std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
    if (v == "0" || v == "false" || v == "no" || v == "off") return false;
    WEFT_FAIL(what << " must be one of 1/0, true/false, yes/no, on/off; got '" << text << "'");
}

std::optional<int64_t> get_int(const char* name) {
    auto v = get(name);
    if (!v) return std::nullopt;
    return parse_int(*v, name);
}

std::optional<uint64_t> get_bytes(const char* name) {
    auto v = get(name);
    if (!v) return std::nullopt;
    return parse_bytes(*v, name);
}

std::optional<bool> get_bool(const char* name) {
    auto v = get(name);
    if (!v) return std::nullopt;
    return parse_bool(*v, name);
}

}  // namespace weft::env
