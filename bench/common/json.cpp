// SPDX-License-Identifier: MIT
// The benchmarks' JSON writer (json.hpp).
#include "common/json.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <stdexcept>

#include "weft/runtime/error.hpp"

namespace weft::bench {

std::string json_string(std::string_view s) {
    std::string out;
    out.reserve(s.size() + 2);
    out += '"';
    for (const char c : s) {
        switch (c) {
            case '"':
                out += "\\\"";
                break;
            case '\\':
                out += "\\\\";
                break;
            case '\b':
                out += "\\b";
                break;
            case '\f':
                out += "\\f";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\r':
                out += "\\r";
                break;
            case '\t':
                out += "\\t";
                break;
            default:
                if (static_cast<unsigned char>(c) < 0x20) {
                    char buf[8];
                    std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
                    out += buf;
                } else {
                    out += c;
                }
        }
    }
    out += '"';
    return out;
}

std::string json_number(double v) {
    if (!std::isfinite(v)) return "null";
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof(buf), v);
    return std::string(buf, r.ptr);
}

void Json::newline() {
    out_ += '\n';
    out_.append(2 * levels_.size(), ' ');
}

void Json::before_value() {
    if (done_) throw std::logic_error("Json: a value after the end of the document");
    if (levels_.empty()) return;
    Level& l = levels_.back();
    if (l.object) {
        if (!l.have_key) throw std::logic_error("Json: a value inside an object needs a key first");
        l.have_key = false;
        return;
    }
    if (!l.empty) out_ += l.inline_ ? ", " : ",";
    if (!l.inline_) newline();
    l.empty = false;
}

Json& Json::raw(const std::string& text) {
    before_value();
    out_ += text;
    if (levels_.empty()) done_ = true;
    return *this;
}

void Json::open(char c, bool object, bool inline_) {
    before_value();
    out_ += c;
    // A container inside an inline one stays on the line too.
    levels_.push_back(Level{object, inline_ || (!levels_.empty() && levels_.back().inline_)});
}

void Json::close(char c, bool object) {
    if (levels_.empty() || levels_.back().object != object) {
        throw std::logic_error(std::string("Json: '") + c + "' closes no open " + (object ? "object" : "array"));
    }
    const Level l = levels_.back();
    if (l.have_key) throw std::logic_error("Json: a key without its value");
    levels_.pop_back();
    if (!l.inline_ && !l.empty) newline();
    out_ += c;
    if (levels_.empty()) done_ = true;
}

Json& Json::begin_object(bool inline_) {
    open('{', true, inline_);
    return *this;
}

Json& Json::end_object() {
    close('}', true);
    return *this;
}

Json& Json::begin_array(bool inline_) {
    open('[', false, inline_);
    return *this;
}

Json& Json::end_array() {
    close(']', false);
    return *this;
}

Json& Json::key(std::string_view k) {
    if (levels_.empty() || !levels_.back().object) throw std::logic_error("Json: a key outside an object");
    Level& l = levels_.back();
    if (l.have_key) throw std::logic_error("Json: two keys in a row");
    if (!l.empty) out_ += l.inline_ ? ", " : ",";
    if (!l.inline_) newline();
    l.empty = false;
    l.have_key = true;
    out_ += json_string(k);
    out_ += ": ";
    return *this;
}

Json& Json::value(std::string_view v) { return raw(json_string(v)); }
Json& Json::value(bool v) { return raw(v ? "true" : "false"); }
Json& Json::value(double v) { return raw(json_number(v)); }
Json& Json::value(std::nullptr_t) { return raw("null"); }

const std::string& Json::str() const {
    if (!done_) throw std::logic_error("Json: the document is not complete");
    return out_;
}

void write_json_file(const std::string& path, const Json& doc) {
    const std::string& text = doc.str();
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    WEFT_CHECK(f.good(), "--json: cannot open '" << path << "' for writing");
    f << text << '\n';
    f.close();
    WEFT_CHECK(!f.fail(), "--json: writing '" << path << "' failed");
}

}  // namespace weft::bench
