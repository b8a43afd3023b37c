// SPDX-License-Identifier: MIT
// The text of the error a call throws, for tests that check what an error message names.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <string>

#include "weft/runtime/error.hpp"

namespace weft::testing {

/// The text of the weft::Error fn() throws, or "" when it returns. Another exception fails the test (ADD_FAILURE,
/// safe on a test's own threads, where it must not escape) and gives its text after "not a weft::Error: ".
template <class Fn>
std::string error_of(Fn&& fn) {
    try {
        fn();
    } catch (const Error& e) {
        return e.what();
    } catch (const std::exception& e) {
        ADD_FAILURE() << "expected a weft::Error or none, got another exception: " << e.what();
        return std::string("not a weft::Error: ") + e.what();
    }
    return "";
}

}  // namespace weft::testing
