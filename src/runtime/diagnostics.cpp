// SPDX-License-Identifier: MIT
// Formatting of device diagnostic records (see include/weft/runtime/diagnostics.hpp).
#include "weft/runtime/diagnostics.hpp"

#include <sstream>

namespace weft {

const char* spin_kind_name(SpinKind kind) {
    switch (kind) {
        case SpinKind::kNone:
            return "an unknown spin";
        case SpinKind::kSignalWait:
            return "signal_wait";
        case SpinKind::kBarrier:
            return "barrier";
        case SpinKind::kTileWait:
            return "tile_wait";
        case SpinKind::kOther:
            return "spin";
        case SpinKind::kUnreachablePeer:
            return "unreachable_peer";
        case SpinKind::kCollectiveMismatch:
            return "collective_mismatch";
    }
    return "an unknown spin";
}

const char* cmp_name(Cmp cmp) {
    switch (cmp) {
        case Cmp::kEq:
            return "EQ";
        case Cmp::kNe:
            return "NE";
        case Cmp::kGt:
            return "GT";
        case Cmp::kGe:
            return "GE";
        case Cmp::kLt:
            return "LT";
        case Cmp::kLe:
            return "LE";
    }
    return "?";
}

const char* cmp_symbol(Cmp cmp) {
    switch (cmp) {
        case Cmp::kEq:
            return "==";
        case Cmp::kNe:
            return "!=";
        case Cmp::kGt:
            return ">";
        case Cmp::kGe:
            return ">=";
        case Cmp::kLt:
            return "<";
        case Cmp::kLe:
            return "<=";
    }
    return "?";
}

std::string format_diagnostic(const Diagnostic& d) {
    std::ostringstream os;
    if (d.claimed != 2) {
        os << "rank " << d.rank
           << ": a device spin timed out but its diagnostic record is incomplete (claimed = " << d.claimed << ")";
        return os.str();
    }
    if (d.kind == SpinKind::kCollectiveMismatch) {
        os << "rank " << d.rank << " block (" << d.block_x << "," << d.block_y << "," << d.block_z
           << "): collective call differs from rank " << d.peer << "'s (call descriptor 0x" << std::hex << d.expected
           << " here, 0x" << d.observed << std::dec
           << " there): every rank must make the same collective calls in the same order, with the same count, "
              "dtype and algorithm, and pass symmetric buffers on all ranks or on none (same allocation)";
        if (d.line > 0) os << " (source line " << d.line << ")";
        return os.str();
    }
    if (d.kind == SpinKind::kUnreachablePeer) {
        // Written by the device layer's symm_at_or_trap: expected = the rank asked for, observed = the
        // heap offset of the address (~0 when it is not inside this rank's symmetric heap).
        // `peer` is the world rank of team rank `expected` (the same for the world team).
        const auto target = static_cast<int64_t>(d.expected);
        std::ostringstream who;
        who << "rank " << (d.peer >= 0 ? d.peer : target);
        if (d.peer >= 0 && d.peer != target) who << " (team rank " << target << ")";
        os << "rank " << d.rank << " block (" << d.block_x << "," << d.block_y << "," << d.block_z << ") thread "
           << d.thread_x << ": a put/get/signal to " << (d.peer >= 0 ? who.str() : "team rank " + std::to_string(target))
           << " on symmetric address 0x" << std::hex << d.signal_addr << std::dec << " failed: ";
        if (d.observed == ~0ull) {
            os << "the address is not inside this rank's symmetric heap";
        } else if (d.peer < 0) {
            os << "no such rank in the team";
        } else {
            os << who.str() << " is not load/store reachable from here (heap offset " << d.observed
               << "; only the load/store transport exists)";
        }
        if (d.line > 0) os << " (source line " << d.line << ")";
        return os.str();
    }
    // Round to whole milliseconds: the device clock advances in 32 ns steps, so more digits add nothing.
    const uint64_t waited_ms = (d.waited_ns + 500000) / 1000000;
    os << "rank " << d.rank << " block (" << d.block_x << "," << d.block_y << "," << d.block_z << ") thread "
       << d.thread_x << " timed out after " << waited_ms << " ms in " << spin_kind_name(d.kind) << " ("
       << cmp_name(d.cmp) << ") on signal 0x" << std::hex << d.signal_addr << std::dec;
    if (d.peer >= 0) os << " owned by rank " << d.peer;
    os << ": expected " << cmp_symbol(d.cmp) << " " << d.expected << ", observed " << d.observed;
    if (d.line > 0) os << " (source line " << d.line << ")";
    return os.str();
}

}  // namespace weft
