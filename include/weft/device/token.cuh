// SPDX-License-Identifier: MIT
// Token: proof that a wait happened. Loads that must follow a wait (TMA loads of data peers wrote, and
// plain loads through consume_token) take a Token, so forgetting the wait does not compile.
#pragma once

namespace weft::device {

/// Returned by `wait(...)` after the signals were observed with acquire semantics and, for data that
/// TMA will read, after `fence.proxy.async.global`. Only `wait` constructs a live Token.
class Token {
public:
    /// A token for data this rank produced itself (no wait needed): the loud name says what it skips.
    __host__ __device__ static constexpr Token assume_local_data() { return Token(0u); }

    __host__ __device__ constexpr unsigned value() const { return value_; }

    /// Used by the tile layer's wait(); carries the observed value so consume_token can depend on it.
    __host__ __device__ explicit constexpr Token(unsigned observed) : value_(observed) {}

private:
    unsigned value_;
};

}  // namespace weft::device
