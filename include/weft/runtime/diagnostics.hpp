// SPDX-License-Identifier: MIT
// Turns the Diagnostic record a timed-out device spin leaves into the host's error message (pure).
#pragma once

#include <string>

#include "weft/common/diagnostics.hpp"

namespace weft {

/// One sentence, e.g. "rank 1 block (3,0,0) thread 0 timed out after 10000 ms in signal_wait (GE) on
/// signal 0x7f0000001000 owned by rank 2: expected >= 5, observed 4". The record must be complete
/// (claimed == 2); an incomplete one is described as such.
std::string format_diagnostic(const Diagnostic& record);

/// A call descriptor (weft/common/collectives.hpp, make_call_descriptor) in words, e.g. "all_reduce (ll) of 1000
/// bf16 elements [0x3100...]" or "all_gather (sm_push) of 4096 bytes [...]"; unknown ops and algorithms by number.
std::string describe_call_descriptor(uint64_t descriptor);

/// "signal_wait", "barrier", "tile_wait", "spin" ...; "EQ", "GE" ...; "==", ">=" ...
const char* spin_kind_name(SpinKind kind);
const char* cmp_name(Cmp cmp);
const char* cmp_symbol(Cmp cmp);

}  // namespace weft
