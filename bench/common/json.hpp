// SPDX-License-Identifier: MIT
// A small JSON writer for the benchmarks' --json files: strings escaped, non-finite numbers written as null.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace weft::bench {

/// `s` as a JSON string literal (quoted): '"' and '\' escaped, control characters as \n, \t, ... or \u00XX.
/// Other bytes pass through unchanged (the benchmarks write ASCII and UTF-8).
std::string json_string(std::string_view s);
/// `v` as a JSON number in its shortest round-trip form; NaN and infinities (not numbers in JSON) as null.
std::string json_number(double v);

/// Writes one JSON document. Containers are opened and closed explicitly; inside an object every value follows a
/// key. A container opened `inline_` keeps its elements on one line (one table row per line stays readable).
/// Misuse (a value without its key, a key in an array, unbalanced closes, str() before the end) throws
/// std::logic_error.
///
///     Json j;
///     j.begin_object().field("bench", "gemm").field("peak_tflops", 701.5);
///     j.key("results").begin_array();
///     for (const Row& r : rows) j.begin_object(true).field("m", r.m).field("us", r.us).end_object();
///     j.end_array().end_object();
///     write_json_file(path, j);
class Json {
public:
    Json& begin_object(bool inline_ = false);
    Json& end_object();
    Json& begin_array(bool inline_ = false);
    Json& end_array();
    Json& key(std::string_view k);

    Json& value(std::string_view v);
    Json& value(const char* v) { return value(std::string_view(v)); }
    Json& value(const std::string& v) { return value(std::string_view(v)); }
    Json& value(bool v);
    Json& value(double v);
    Json& value(std::nullptr_t);
    template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
    Json& value(T v) {
        if constexpr (std::is_signed_v<T>) {
            return raw(std::to_string(static_cast<long long>(v)));
        } else {
            return raw(std::to_string(static_cast<unsigned long long>(v)));
        }
    }
    Json& value(float v) { return value(static_cast<double>(v)); }

    template <class T>
    Json& field(std::string_view k, const T& v) {
        key(k);
        return value(v);
    }

    /// The document; the outermost container must be closed.
    const std::string& str() const;

private:
    struct Level {
        bool object;
        bool inline_;
        bool empty = true;
        bool have_key = false;
    };
    Json& raw(const std::string& text);  // a value's text, after the separator its position needs
    void before_value();
    void open(char c, bool object, bool inline_);
    void close(char c, bool object);
    void newline();
    std::string out_;
    std::vector<Level> levels_;
    bool done_ = false;
};

/// Writes the document to `path` (replacing it); throws weft::Error naming the path when it cannot.
void write_json_file(const std::string& path, const Json& doc);

}  // namespace weft::bench
