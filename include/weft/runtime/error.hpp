// SPDX-License-Identifier: MIT
// weft::Error and the checking macros every host call site uses.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

namespace weft {

/// The one exception type weft throws. The message says what was expected and what was found.
class Error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, const std::string& message);
[[noreturn]] void throw_cuda_error(const char* file, int line, const char* call, cudaError_t status);
}  // namespace detail

}  // namespace weft

/// Throws weft::Error with a streamed message when `cond` is false:
/// `WEFT_CHECK(n > 0, "num_ranks must be positive, got " << n);`
#define WEFT_CHECK(cond, msg)                                                    \
    do {                                                                         \
        if (!(cond)) {                                                           \
            std::ostringstream weft_check_os_;                                   \
            weft_check_os_ << msg;                                               \
            ::weft::detail::throw_error(__FILE__, __LINE__, weft_check_os_.str()); \
        }                                                                        \
    } while (0)

/// Throws weft::Error with a streamed message.
#define WEFT_FAIL(msg) WEFT_CHECK(false, msg)

/// Checks a CUDA runtime call; the error names the call, the status and the location.
#define WEFT_CUDA_CHECK(call)                                                    \
    do {                                                                         \
        cudaError_t weft_status_ = (call);                                       \
        if (weft_status_ != cudaSuccess) {                                       \
            ::weft::detail::throw_cuda_error(__FILE__, __LINE__, #call, weft_status_); \
        }                                                                        \
    } while (0)
