// SPDX-License-Identifier: MIT
// Formatting of device diagnostic records (see include/weft/runtime/diagnostics.hpp).
#include "weft/runtime/diagnostics.hpp"

#include <sstream>

#include "weft/common/collectives.hpp"
#include "weft/common/dtype.hpp"

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
        case SpinKind::kCollectiveEpoch:
            return "collective_epoch";
        case SpinKind::kAllToAllCounts:
            return "all_to_all_counts";
        case SpinKind::kBadArgument:
            return "bad_argument";
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

namespace {

const char* op_name(CollectiveOp op) {
    switch (op) {
        case CollectiveOp::kNone: return nullptr;
        case CollectiveOp::kAllGather: return "all_gather";
        case CollectiveOp::kReduceScatter: return "reduce_scatter";
        case CollectiveOp::kAllReduce: return "all_reduce";
        case CollectiveOp::kAllToAll: return "all_to_all";
        case CollectiveOp::kAttentionCombine: return "sp_decode_attention's combine";
        case CollectiveOp::kAllToAllV: return "all_to_all_v";
        case CollectiveOp::kGemmAr: return "gemm_ar";
        case CollectiveOp::kAgGemm: return "ag_gemm";
        case CollectiveOp::kGemmRs: return "gemm_rs";
        case CollectiveOp::kAgAttention:
            return "ag_attention";
        case CollectiveOp::kMoeAgGemm:
            return "moe_ag_grouped_gemm";
    }
    return nullptr;
}

// The names ops::algo_name gives (a unit test keeps them equal); nullptr for an op without algorithms.
const char* algo_name_of(CollectiveOp op, uint32_t algo) {
    static constexpr const char* kAllReduce[] = {"auto", "ll", "one_shot", "two_shot"};
    static constexpr const char* kAllGather[] = {"auto", "ll", "sm_push", "ce_pull", "ce_push"};
    static constexpr const char* kReduceScatter[] = {"auto", "sm_pull", "ll"};
    static constexpr const char* kAllToAll[] = {"direct", "staged"};
    switch (op) {
        case CollectiveOp::kAllReduce: return algo < 4 ? kAllReduce[algo] : "?";
        case CollectiveOp::kAllGather: return algo < 5 ? kAllGather[algo] : "?";
        case CollectiveOp::kReduceScatter: return algo < 3 ? kReduceScatter[algo] : "?";
        case CollectiveOp::kAllToAll: return algo < 2 ? kAllToAll[algo] : "?";
        // Uneven splits: ranks may differ in staging (a rank that sends nothing stages), so it is not in the call.
        case CollectiveOp::kAllToAllV: return nullptr;
        default: return nullptr;
    }
}

}  // namespace

std::string describe_call_descriptor(uint64_t descriptor) {
    std::ostringstream os;
    const CollectiveOp op = call_descriptor_op(descriptor);
    const uint32_t algo = call_descriptor_algo(descriptor);
    const uint32_t dtype_plus_one = call_descriptor_dtype_plus_one(descriptor);
    const uint64_t count = call_descriptor_count(descriptor);
    const char* name = op_name(op);
    if (name == nullptr) {
        os << "an unknown call (op " << static_cast<uint32_t>(op) << ")";
    } else {
        os << name;
        const char* a = algo_name_of(op, algo);
        if (a != nullptr) os << " (" << (a[0] == '?' ? "algorithm " + std::to_string(algo) : std::string(a)) << ")";
        const std::string at_least = count >= kCallDescriptorMaxCount ? "at least " : "";
        const std::string dt = dtype_plus_one == 0 ? std::string()
                                                   : std::string(dtype_name(static_cast<DType>(dtype_plus_one - 1)));
        if (op == CollectiveOp::kGemmAr || op == CollectiveOp::kAgGemm || op == CollectiveOp::kGemmRs) {
            const char* role = op == CollectiveOp::kGemmAr ? " output" : op == CollectiveOp::kGemmRs ? " partials" : "";
            os << " with M = " << at_least << count << (dt.empty() ? "" : ", " + dt + role);
        } else if (op == CollectiveOp::kAgAttention) {
            os << " with S = " << at_least << count << (dt.empty() ? "" : ", " + dt);
        } else if (op == CollectiveOp::kMoeAgGemm) {
            os << " with M = " << at_least << count << " tokens (its topk_idx in the digest)";
        } else if (op == CollectiveOp::kAllToAllV) {
            os << " (uneven splits)";
        } else if (op == CollectiveOp::kAttentionCombine) {
            os << " of " << at_least << count << " rows" << (dt.empty() ? "" : " of " + dt);
        } else if (dt.empty()) {
            os << " of " << at_least << count << " bytes";
        } else {
            os << " of " << at_least << count << " " << dt << " elements";
        }
    }
    os << " [descriptor 0x" << std::hex << descriptor << "]";
    return os.str();
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
           << "): collective call differs from rank " << d.peer << "'s: rank " << d.rank << " called "
           << describe_call_descriptor(d.expected) << ", rank " << d.peer << " called "
           << describe_call_descriptor(d.observed)
           << "; every rank must make the same collective calls in the same order, with the same shape, "
              "dtype and algorithm, and pass symmetric buffers on all ranks or on none (same allocation)";
        const CollectiveOp op = call_descriptor_op(d.expected);
        const bool counted = op == CollectiveOp::kAllReduce || op == CollectiveOp::kAllGather ||
                             op == CollectiveOp::kReduceScatter || op == CollectiveOp::kAllToAll ||
                             op == CollectiveOp::kAllToAllV;  // the ops that fold in their call's place
        if (counted && d.expected >> 20 == d.observed >> 20 && d.expected != d.observed) {
            os << " (the two agree in op, algorithm, dtype and count, so they differ in where their buffers lie on "
                  "the heap or in their place in the team's sequence of collective calls: one rank made a call the "
                  "other did not, such as one of 0 elements or one refused on that rank alone)";
        }
        if (call_descriptor_op(d.expected) == CollectiveOp::kAttentionCombine) {
            os << " (sp_decode_attention reads a peer's call from 32 bits of its pushed rows: where the peer's"
                  " rows are laid out otherwise, another head_dim, those bits are not its call's and its row count"
                  " as shown means nothing)";
        }
        if (d.line > 0) os << " (source line " << d.line << ")";
        return os.str();
    }
    if (d.kind == SpinKind::kAllToAllCounts) {
        os << "rank " << d.rank << " block (" << d.block_x << "," << d.block_y << "," << d.block_z
           << "): all_to_all_v counts differ: rank " << d.rank << " expects " << d.expected << " bytes from rank "
           << d.peer << ", which sends it " << d.observed << " bytes; rank q's send_counts[r] must equal rank r's "
           << "recv_counts[q] (q and r: team ranks; the ranks named here are world ranks); this rank read nothing "
              "from it";
        if (d.line > 0) os << " (source line " << d.line << ")";
        return os.str();
    }
    if (d.kind == SpinKind::kBadArgument) {
        os << "rank " << d.rank << " block (" << d.block_x << "," << d.block_y << "," << d.block_z << ") thread "
           << d.thread_x << ": a device call refused its arguments: ";
        if (d.waited_ns == kBadGroupSize) {
            os << "a " << (d.expected == 32 ? "Warp" : "Warpgroup") << " group needs a block of whole "
               << (d.expected == 32 ? "warps" : "warpgroups") << " (a thread count that is a multiple of " << d.expected
               << "), this block has " << d.observed
               << " threads (the missing lanes' share of a copy would not be done)";
        } else if (d.waited_ns == kBadBarrierId) {
            os << "Warpgroup{" << d.observed << "}: the named barrier id must be 1..15 (0 is __syncthreads' own)";
        } else if (d.waited_ns == kBadWaitCount) {
            os << "tile::wait of " << static_cast<int64_t>(d.observed) << " signals: the count must be >= 0";
        } else {
            os << "(unknown refusal " << d.waited_ns << ")";
        }
        if (d.line > 0) os << " (source line " << d.line << ")";
        return os.str();
    }
    if (d.kind == SpinKind::kCollectiveEpoch) {
        // Written by BlockState (kernels/common/collective.cuh): expected = the kernel's call descriptor, waited_ns =
        // its epoch << 16 | the done count it found; kNe (at its start): observed = the claim another kernel left
        // under that epoch; kLt (at its start) and kGe (at its end): observed = grid << 32 | the done count.
        const uint64_t done = d.observed & 0xFFFFFFFFull;
        const uint64_t grid = d.observed >> 32;
        os << "rank " << d.rank << " block (" << d.block_x << "," << d.block_y << "," << d.block_z
           << "): this rank's collective kernels are out of step: " << describe_call_descriptor(d.expected)
           << " runs under epoch " << (d.waited_ns >> 16) << ", ";
        if (d.cmp == Cmp::kNe) {
            os << "under which another collective kernel of this rank (descriptor ending 0x" << std::hex
               << (d.observed & 0xFFFFFFFFull) << std::dec
               << ") already finished blocks: the epoch was not advanced between the two (" << (d.waited_ns & 0xFFFF)
               << " blocks counted done at this kernel's start); this kernel ended before writing anything";
        } else if (d.cmp == Cmp::kLt) {
            os << "but " << done << " blocks were counted done before it started, for its grid of " << grid
               << ": an earlier kernel's blocks were miscounted, or ended early (so the epoch may not have "
                  "advanced); this kernel ended before writing anything";
        } else {
            os << "and counted " << done + 1 << " blocks done at its end for its grid of " << grid
               << ": blocks were counted that are not its own, so it did not advance the epoch (its data moved)";
        }
        os << ". The peers' calls now pair with other kernels of this rank: replace the World (its collective state "
              "is not repaired)";
        if (d.line > 0) os << " (source line " << d.line << ")";
        return os.str();
    }
    if (d.kind == SpinKind::kUnreachablePeer) {
        // Written by the device layer's symm_at_or_trap: expected = the rank asked for, observed = the
        // heap offset of the address (~0 when it is not inside this rank's symmetric heap); cmp kLe from
        // symm_range_at_or_trap, with waited_ns = the bytes that run past the heap's end.
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
        } else if (d.cmp == Cmp::kLe) {  // symm_range_at_or_trap: waited_ns holds the byte count
            os << "its " << d.waited_ns << " bytes from heap offset " << d.observed
               << " run past the end of this rank's symmetric heap (a size larger than the buffer)";
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
       << d.thread_x << (d.aborted != 0 ? " stopped (the World was aborted) after " : " timed out after ") << waited_ms
       << " ms in " << spin_kind_name(d.kind) << " ("
       << cmp_name(d.cmp) << ") on signal 0x" << std::hex << d.signal_addr << std::dec;
    if (d.peer >= 0) os << " owned by rank " << d.peer;
    os << ": expected " << cmp_symbol(d.cmp) << " " << d.expected << ", observed " << d.observed;
    if (d.line > 0) os << " (source line " << d.line << ")";
    return os.str();
}

}  // namespace weft
