// SPDX-License-Identifier: MIT
// Strict command-line integers for the examples: a whole decimal argument within a range, or one line saying what is
// wrong, the usage line and exit status 2. Host C++ only (no CUDA): .cpp and .cu examples include it alike.
#pragma once

#include <charconv>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <system_error>
#include <type_traits>
#include <variant>

namespace weft::examples {

/// A program's command line and its usage line, "usage: <argv[0]> <usage>".
class Args {
public:
    Args(int argc, char** argv, const char* usage) : argc_(argc), argv_(argv), usage_(usage) {}

    /// Prints "<argv[0]>: <why>" and the usage line to stderr, then exits with status 2.
    [[noreturn]] void fail(const std::string& why) const {
        std::fprintf(stderr, "%s: %s\nusage: %s %s\n", argv_[0], why.c_str(), argv_[0], usage_);
        std::exit(2);
    }

    /// `text`, the value of `what` ("--m", "argument 2 (rounds)"), as a decimal integer in [lo, hi] (a range T holds).
    /// std::from_chars must take all of it, so "", " 1", "+1", "12x", "1e3" and anything out of range fail().
    template <std::integral T>
    T parse(const std::string& what, const char* text, int64_t lo, int64_t hi) const {
        const char* end = text + std::strlen(text);
        int64_t value = 0;
        const auto [stop, error] = std::from_chars(text, end, value);
        if (error != std::errc{} || stop != end || value < lo || value > hi) {
            fail(what + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" +
                 text + "'");
        }
        return static_cast<T>(value);
    }

    /// One "--name value" flag: an integer in [lo, hi] stored into `target` (an int or an int64_t).
    struct Flag {
        const char* name;
        std::variant<int*, int64_t*> target;
        int64_t lo, hi;
    };

    /// Reads the command line as "--name value" pairs of `flags` (a flag not given keeps its value); an unknown flag
    /// or a bad value fail()s.
    void read_flags(std::initializer_list<Flag> flags) const {
        for (int i = 1; i < argc_; i += 2) {
            const std::string name = argv_[i];
            const char* value = i + 1 < argc_ ? argv_[i + 1] : "";
            const Flag* flag = nullptr;
            for (const Flag& f : flags) {
                if (name == f.name) flag = &f;
            }
            if (flag == nullptr) fail("unknown flag '" + name + "'");
            std::visit(
                [&](auto* target) {
                    *target = parse<std::remove_pointer_t<decltype(target)>>(name, value, flag->lo, flag->hi);
                },
                flag->target);
        }
    }

    /// fail()s when the program was given more than `count` arguments (a program that reads positional arguments
    /// only: an extra one is a mistake, not something to ignore).
    void at_most(int count) const {
        if (argc_ - 1 > count) {
            fail("takes at most " + std::to_string(count) + " argument(s), got " + std::to_string(argc_ - 1));
        }
    }

    /// argv[i] read by parse() as "argument i (name)", or `fallback` when the program was given fewer arguments.
    template <std::integral T>
    T positional(int i, const char* name, int64_t lo, int64_t hi, T fallback) const {
        if (i >= argc_) return fallback;
        return parse<T>("argument " + std::to_string(i) + " (" + name + ")", argv_[i], lo, hi);
    }

private:
    int argc_;
    char** argv_;
    const char* usage_;
};

}  // namespace weft::examples
