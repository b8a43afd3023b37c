// SPDX-License-Identifier: MIT
// Token: proof that a wait happened. Loads that must follow a wait (TMA loads of data peers wrote, and plain
// loads through consume_token) take a Token, and nothing but a wait can make one, so forgetting the wait does
// not compile.
//
// Who makes a Token: the tile layer's waits (tile::wait, tile::wait_each and their _checked forms, weft/device/
// tile.cuh, all implemented by detail::TokenIssuer) and, for data the caller wrote itself, the loudly named
// Token::assume_local_data(). A Token has no public constructor: `Token(x)`, `Token{x}` and `Token t;` do not
// compile ("... is inaccessible" / "no default constructor").
#pragma once

namespace weft::device {

namespace detail {
struct TokenIssuer;  // tile.cuh: the waits; every member waits and fences before it makes a Token
}  // namespace detail

/// Returned by a wait after the signals were observed with acquire semantics, the group synchronised, and every
/// thread issued `fence.proxy.async.global` (so TMA loads of the data see it too). Copyable: the proof holds
/// wherever the value flows in the thread that received it.
class Token {
public:
    /// A token for data this rank produced itself (no wait needed): the loud name says what it skips.
    __host__ __device__ static constexpr Token assume_local_data() { return Token(0u); }

    /// The value the wait observed (the last signal value this thread polled, 0 when it polled none): what
    /// consume_token makes a load depend on.
    __host__ __device__ constexpr unsigned value() const { return value_; }

private:
    friend struct detail::TokenIssuer;
    // NOTE: private on purpose: only a wait (detail::TokenIssuer) or assume_local_data() makes a Token.
    __host__ __device__ explicit constexpr Token(unsigned observed) : value_(observed) {}

    unsigned value_;
};

/// The outcome of a wait that returns instead of trapping (tile::wait_checked, tile::wait_each_checked): ok() is
/// the same in every thread of the group. When it is false the wait timed out or the World was aborted (its
/// Diagnostic is recorded, the abort word raised): the data it guarded is not valid, the token() only keeps the code
/// that follows well-formed, and the kernel must not publish what it computes from that data and must end once it
/// may (token_or_exit, device::exit_unless; or trap where its pipelines cannot drain).
class [[nodiscard]] WaitResult {
public:
    __device__ __forceinline__ bool ok() const { return ok_; }
    __device__ __forceinline__ Token token() const { return token_; }
    /// token(), after ending the kernel with `trap` when the wait failed (its Diagnostic is recorded). Inline: the
    /// trapping form for code that may trap but must not call (the __noinline__ failure path of tile::wait would
    /// be a call), such as a GEMM's producer warp.
    __device__ __forceinline__ Token token_or_trap() const {
        if (!ok_) {
            __trap();
        }
        return token_;
    }
    /// token(), after ending every thread of the group with PTX `exit` when the wait failed (ok() is uniform, so the
    /// whole group ends together; see the rule in weft/device/spin.cuh). Inline: no call, and the CUDA context
    /// stays usable.
    __device__ __forceinline__ Token token_or_exit() const {
        if (!ok_) {
            asm volatile("exit;" ::: "memory");
            __builtin_unreachable();
        }
        return token_;
    }

private:
    friend struct detail::TokenIssuer;
    __device__ __forceinline__ WaitResult(bool ok, Token token) : ok_(ok), token_(token) {}

    bool ok_;
    Token token_;
};

}  // namespace weft::device
