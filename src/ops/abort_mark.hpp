// SPDX-License-Identifier: MIT
// Ops whose device protocol state (flags, epochs, counters) outlives a call: the abort they must not run past.
#pragma once

#include <cstdint>
#include <exception>

namespace weft {
class World;
}  // namespace weft

namespace weft::ops::detail {

/// The World's cleared-abort count when the op (or workspace) was made. A wait that gave up or an abort may leave the
/// op's device state out of step across ranks (one rank's kernel ended early, a peer's ran on), and
/// World::clear_diagnostics does not repair it: once an abort was cleared, check() refuses the op's calls.
struct AbortMark {
    uint64_t cleared_at_make = 0;

    void note(const World& world);
    /// Throws weft::Error "<what>: this World was aborted after <what> was made (<reason>) ... <remedy>" once an
    /// abort was cleared since note().
    void check(const World& world, const char* what, const char* remedy) const;
};

/// Logs a failed release of `what`'s symmetric memory (a collective heap free in a destructor): at INFO when the World
/// was aborted (every store wait then fails at once; the memory goes with the World's heap, and the abort was reported
/// already), else as an ERROR with `e`.
void log_failed_release(const World& world, const char* what, const std::exception& e) noexcept;

}  // namespace weft::ops::detail
