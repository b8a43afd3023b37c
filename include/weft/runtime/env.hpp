// SPDX-License-Identifier: MIT
// Typed, validated reads of environment variables. A malformed value is a weft::Error naming the variable.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace weft::env {

/// The raw value, or nullopt when unset. An empty value counts as set.
std::optional<std::string> get(const char* name);
/// Integer value; throws weft::Error naming `name` when the text is not a whole integer.
std::optional<int64_t> get_int(const char* name);
/// Byte size with an optional suffix K, M, G (powers of 1024), e.g. "512M".
std::optional<uint64_t> get_bytes(const char* name);
/// Boolean: 1/0, true/false, yes/no, on/off (case-insensitive).
std::optional<bool> get_bool(const char* name);

/// Parsers used by the getters (exposed for tests). Each throws weft::Error naming `what`.
int64_t parse_int(const std::string& text, const char* what);
uint64_t parse_bytes(const std::string& text, const char* what);
bool parse_bool(const std::string& text, const char* what);

}  // namespace weft::env
