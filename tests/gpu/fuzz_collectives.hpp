// SPDX-License-Identifier: MIT
// The communication ops' fuzz cases on any team (the World's or a split of it), shared by the suites that run them:
// all_reduce / all_gather / reduce_scatter (GpuFuzz.Collectives, GpuFuzz.Teams) and all_to_all / all_to_all_v
// (GpuFuzz.AllToAllV, GpuFuzz.Teams). A case is drawn for a team of `ranks` ranks and run by each member on its stream
// from the world's buffers (CollBuffers); inputs are functions of (seed, the member's WORLD rank, index), so every
// member computes the whole reference on the host and a result in the wrong rank order shows: the reductions sum small
// integers (exact in bf16, f16 and f32 in any order), the gathers and all-to-alls move hashed bytes. Outputs are
// poisoned (0xFF) and every byte around them is checked. Invalid cases (the headers' weft::Error refusals, made alike
// on every member) must throw naming the op before anything is launched and leave the output as it was.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_harness.hpp"
#include "support/tp_reference.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/symmetric_heap.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace weft::fuzz_test {

/// A world's buffers for these cases, each of `capacity` bytes: a symmetric input and output (World heap allocations,
/// so the same allocation on every rank and usable by any team's op) and a local (cudaMalloc) input and output.
/// Made and released collectively over the world.
struct CollBuffers {
    uint64_t capacity = 0;
    uint8_t *sym_in = nullptr, *sym_out = nullptr, *local_in = nullptr, *local_out = nullptr;
    CollBuffers(World& w, uint64_t bytes) : capacity(bytes) {
        check_cuda(cudaMalloc(reinterpret_cast<void**>(&local_in), capacity), "cudaMalloc");
        check_cuda(cudaMalloc(reinterpret_cast<void**>(&local_out), capacity), "cudaMalloc");
        sym_in = static_cast<uint8_t*>(w.heap().alloc(capacity));
        sym_out = static_cast<uint8_t*>(w.heap().alloc(capacity));
    }
    ~CollBuffers() {
        if (local_in) cudaFree(local_in);
        if (local_out) cudaFree(local_out);
    }
    CollBuffers(const CollBuffers&) = delete;
    CollBuffers& operator=(const CollBuffers&) = delete;
    /// Collective over the world, after every rank's stream is idle.
    void release(World& w) {
        w.heap().free(sym_out);
        w.heap().free(sym_in);
    }
};

/// A rank's stream and CollBuffers for a world's cases, and the world's collectives workspace (made by its setup, so
/// every collective kernel is loaded before a case's kernels spin). fuzz_worlds' Rank.
struct CollRank {
    StreamRank stream;
    CollBuffers buffers;
    CollRank(World& w, uint64_t capacity) : stream(w), buffers(w, capacity) {
        ops::prepare_collectives(w);
        w.barrier();
    }
    void teardown(World& w) {
        stream.teardown(w);
        buffers.release(w);
    }
};

/// A team's op on the World overload when the team is the world's (the overload GpuFuzz.Collectives and
/// GpuFuzz.AllToAllV have always called), else on the team.
template <class Fn>
void on_team(const Team& team, Fn&& fn) {
    if (team.is_world()) {
        fn(team.world());
    } else {
        fn(team);
    }
}

// ---- all_reduce / all_gather / reduce_scatter -----------------------------------------------------------------------

enum class CollOp { kAllReduce, kAllGather, kReduceScatter };
inline const char* coll_op_name(CollOp o) {
    return o == CollOp::kAllReduce ? "all_reduce" : o == CollOp::kAllGather ? "all_gather" : "reduce_scatter";
}

/// Invalid calls (collectives.hpp and each op's header), the same on every member.
enum class CollBad {
    kNone,
    kDtypeMismatch,    // output in another dtype (same element size)
    kNotReducible,     // all_reduce / reduce_scatter of i32
    kCountMismatch,    // output's count not the op's
    kPartialOverlap,   // input and output overlap but not in place
    kMisaligned,       // input not aligned to its element size
    kAlgoRange,        // options.algo not an enum value
    kPushLocalOutput,  // all_gather sm_push / ce_push into a local output (ranks >= 2)
    kNotContiguous,    // a strided input
    kCount
};
inline const char* coll_bad_name(CollBad b) {
    static const char* const kNames[] = {
        "none",       "dtype_mismatch",    "not_reducible",     "count_mismatch", "partial_overlap",
        "misaligned", "algo_out_of_range", "push_local_output", "not_contiguous"};
    return kNames[static_cast<int>(b)];
}

struct CollCase {
    int ranks = 1;  // the team's
    CollOp op = CollOp::kAllReduce;
    DType dt = DType::kF32;
    int algo = 0;        // the op's enum value
    uint64_t count = 1;  // all_reduce: the message; all_gather: the shard; reduce_scatter: the output
    bool in_place = false, in_sym = false, out_sym = false;
    std::vector<uint64_t> in_off, out_off;  // per team rank, bytes (the same on every rank for a symmetric buffer)
    CollBad bad = CollBad::kNone;
    bool invalid() const { return bad != CollBad::kNone; }
};

inline const char* coll_algo_name(const CollCase& c) {
    if (c.algo < 0 || c.algo > 4 || (c.op == CollOp::kAllReduce && c.algo > 3) ||
        (c.op == CollOp::kReduceScatter && c.algo > 2))
        return "out_of_range";
    switch (c.op) {
        case CollOp::kAllReduce:
            return ops::algo_name(static_cast<ops::AllReduceAlgo>(c.algo));
        case CollOp::kAllGather:
            return ops::algo_name(static_cast<ops::AllGatherAlgo>(c.algo));
        default:
            return ops::algo_name(static_cast<ops::ReduceScatterAlgo>(c.algo));
    }
}

inline std::string describe(const CollCase& c) {
    std::ostringstream os;
    os << coll_op_name(c.op) << " ranks=" << c.ranks << " " << dtype_name(c.dt) << " algo=" << coll_algo_name(c)
       << " count=" << c.count << (c.in_place ? " in-place" : " out-of-place") << " input "
       << (c.in_sym ? "symmetric" : "local") << ", output " << (c.out_sym ? "symmetric" : "local") << " in_off=[";
    for (size_t q = 0; q < c.in_off.size(); ++q) os << (q ? "," : "") << c.in_off[q];
    os << "] out_off=[";
    for (size_t q = 0; q < c.out_off.size(); ++q) os << (q ? "," : "") << c.out_off[q];
    os << "] invalid=" << coll_bad_name(c.bad);
    return os.str();
}

/// A case for a team of `ranks` ranks whose largest buffer holds at most `max_bytes` (its CollBuffers' capacity must
/// be max_bytes + 4096 + kGuard: offsets and the guard); an invalid one with probability `invalid_p`.
inline CollCase draw_coll(Rng& r, int ranks, uint64_t max_bytes, double invalid_p = 0.12) {
    CollCase c;
    c.ranks = ranks;
    const uint64_t nr = static_cast<uint64_t>(c.ranks);
    c.op = static_cast<CollOp>(r.uniform(0, 2));
    c.dt = c.op == CollOp::kAllGather
               ? r.pick({DType::kU8, DType::kF8E4M3, DType::kBF16, DType::kF16, DType::kF32, DType::kI32, DType::kI64})
               : r.pick({DType::kBF16, DType::kF16, DType::kF32});
    c.algo = static_cast<int>(r.uniform(0, c.op == CollOp::kAllReduce ? 3 : c.op == CollOp::kAllGather ? 4 : 2));
    const uint64_t es = static_cast<uint64_t>(dtype_bytes(c.dt));
    // Bytes of the largest buffer within max_bytes; the host's reference (W values per element) bounded too.
    const uint64_t per = c.op == CollOp::kAllReduce ? 1 : nr;
    const uint64_t max_count =
        std::max<uint64_t>(1, std::min<uint64_t>(max_bytes / es / per, (12ull << 20) / (nr * per)));
    const double u = r.real(0, 1);
    c.count = u < 0.03   ? 0
              : u < 0.3  ? static_cast<uint64_t>(r.uniform(1, 40))
              : u < 0.65 ? static_cast<uint64_t>(r.log_uniform(1, 100000))
                         : static_cast<uint64_t>(r.log_uniform(1, static_cast<int64_t>(max_count)));
    c.count = std::min(c.count, max_count);
    if (r.chance(0.5) && c.count > 1) c.count |= 1;  // odd counts
    c.in_place = r.chance(0.3);
    // Symmetric buffers on every member or on none (collectives.hpp); in place, input and output are one buffer.
    c.out_sym = r.chance(0.5);
    c.in_sym = c.in_place ? c.out_sym : r.chance(0.5);
    const uint64_t sym_in = es * static_cast<uint64_t>(r.uniform(0, 255 / static_cast<int64_t>(es)));
    const uint64_t sym_out = es * static_cast<uint64_t>(r.uniform(0, 255 / static_cast<int64_t>(es)));
    for (int q = 0; q < c.ranks; ++q) {
        const uint64_t li = es * static_cast<uint64_t>(r.uniform(0, 255 / static_cast<int64_t>(es)));
        const uint64_t lo = es * static_cast<uint64_t>(r.uniform(0, 255 / static_cast<int64_t>(es)));
        c.in_off.push_back(c.in_sym ? sym_in : li);
        c.out_off.push_back(c.out_sym ? sym_out : lo);
    }
    // A push all-gather needs a symmetric output: a local one is an invalid case of its own (below).
    if (c.op == CollOp::kAllGather && !c.out_sym && (c.algo == 2 || c.algo == 4)) c.algo = r.pick({0, 1, 3});
    if (r.chance(invalid_p)) {
        c.bad = static_cast<CollBad>(r.uniform(1, static_cast<int>(CollBad::kCount) - 1));
        c.count = std::max<uint64_t>(4, std::min<uint64_t>(c.count, 4096));
        c.in_place = false;
        if (c.bad == CollBad::kNotReducible && c.op == CollOp::kAllGather) c.bad = CollBad::kDtypeMismatch;
        if (c.bad == CollBad::kMisaligned && es == 1) c.dt = DType::kF32;
        if (c.bad == CollBad::kPushLocalOutput) {
            // On one rank the call is a copy and the algorithm is not looked at (a doc/code difference): another kind.
            if (c.op != CollOp::kAllGather || c.ranks == 1) {
                c.bad = CollBad::kAlgoRange;
            } else {
                c.out_sym = false;
                c.algo = r.chance(0.5) ? 2 : 4;
            }
        }
        if (c.bad == CollBad::kAlgoRange) c.algo = r.pick({5, 9, -1});
        for (int q = 0; q < c.ranks; ++q) {  // offsets of the (possibly changed) dtype
            const uint64_t e2 = static_cast<uint64_t>(dtype_bytes(c.dt));
            c.in_off[static_cast<size_t>(q)] = c.in_off[static_cast<size_t>(q)] / e2 * e2;
            c.out_off[static_cast<size_t>(q)] = c.out_off[static_cast<size_t>(q)] / e2 * e2;
        }
    }
    return c;
}

/// The valid call an invalid case stands for (the same buffers and count): what a team runs after the refusal, to
/// show that the refusal left it usable.
inline CollCase valid_twin(CollCase c) {
    const bool push = c.op == CollOp::kAllGather && (c.algo == 2 || c.algo == 4);
    if (c.bad == CollBad::kAlgoRange || (push && !c.out_sym)) c.algo = 0;
    c.bad = CollBad::kNone;
    return c;
}

/// A small integer in [-8, 8]: sums of up to 8 ranks are exact in bf16, f16 and f32, in any order.
inline int32_t coll_value(uint64_t seed, int rank, uint64_t i) {
    return static_cast<int32_t>(mix64(seed ^ mix64((static_cast<uint64_t>(rank) << 48) ^ i)) % 17) - 8;
}
inline uint8_t coll_byte(uint64_t seed, int rank, uint64_t i) {
    return static_cast<uint8_t>(mix64(seed ^ mix64((static_cast<uint64_t>(rank + 100) << 48) ^ i)));
}

/// The bits of integer v in a reducible dtype.
inline uint32_t int_bits(int32_t v, DType t) {
    if (t == DType::kF32) {
        const float f = static_cast<float>(v);
        uint32_t b;
        std::memcpy(&b, &f, 4);
        return b;
    }
    return tp_test::float_to_bits(t, static_cast<float>(v));
}

/// World rank `rank`'s input bytes of a case: small integers for the reducing ops, random bytes for all_gather.
inline std::vector<uint8_t> coll_input(const CollCase& c, uint64_t seed, int rank, uint64_t elems) {
    const uint64_t es = static_cast<uint64_t>(dtype_bytes(c.dt));
    std::vector<uint8_t> v(elems * es);
    if (c.op == CollOp::kAllGather) {
        for (uint64_t i = 0; i < v.size(); ++i) v[i] = coll_byte(seed, rank, i);
    } else {
        for (uint64_t i = 0; i < elems; ++i) {
            const uint32_t b = int_bits(coll_value(seed, rank, i), c.dt);
            std::memcpy(v.data() + i * es, &b, es);
        }
    }
    return v;
}

/// Runs a case on `team` (every member calls it; c.ranks == team.num_ranks()) and checks this member's output: ""
/// or what went wrong. An invalid case must be refused, leaving the output's bytes as they were.
inline std::string run_coll(const CollCase& c, uint64_t seed, const Team& team, const CollBuffers& b, cudaStream_t st) {
    const int nr = c.ranks, me = team.rank();
    const uint64_t es = static_cast<uint64_t>(dtype_bytes(c.dt)), n = c.count, unr = static_cast<uint64_t>(nr);
    // Elements of the input and output views.
    const uint64_t in_elems = c.op == CollOp::kReduceScatter ? n * unr : n;
    const uint64_t out_elems = c.op == CollOp::kAllGather ? n * unr : n;
    uint8_t* const in_base = c.in_sym ? b.sym_in : b.local_in;
    uint8_t* const out_base = c.out_sym ? b.sym_out : b.local_out;
    uint8_t* out = out_base + c.out_off[static_cast<size_t>(me)];
    uint8_t* in = in_base + c.in_off[static_cast<size_t>(me)];
    if (c.in_place) {
        if (c.op == CollOp::kAllReduce) in = out;
        if (c.op == CollOp::kAllGather) in = out + static_cast<uint64_t>(me) * n * es;
        if (c.op == CollOp::kReduceScatter) {
            in = out_base + c.out_off[static_cast<size_t>(me)];  // the input is the buffer; the output its slice
            out = in + static_cast<uint64_t>(me) * n * es;
        }
    }
    // The span of the output's buffer that is checked: from its base to the guard past the data (in place: past the
    // input, which is in the same buffer).
    uint8_t* const check_base = out_base;
    const uint64_t data_end = static_cast<uint64_t>(out - check_base) + out_elems * es;
    const uint64_t in_end = c.in_place ? static_cast<uint64_t>(in - check_base) + in_elems * es : 0;
    const uint64_t span = std::max(data_end, in_end) + kGuard;
    const uint64_t lo =
        c.in_place ? static_cast<uint64_t>(std::min(in, out) - check_base) : static_cast<uint64_t>(out - check_base);
    check_cuda(cudaMemsetAsync(check_base, 0xFF, span, st), "poison");
    const std::vector<uint8_t> mine = coll_input(c, seed, team.world_rank(me), in_elems);
    to_dev(in, mine.data(), mine.size(), st);
    // A refused call writes nothing: neither the output's buffer nor the input's (an overlapping invalid view points
    // into the input), from its base to the guard past the input.
    const uint64_t in_span = static_cast<uint64_t>(in - in_base) + in_elems * es + kGuard;
    std::vector<uint8_t> before, before_in;
    if (c.bad != CollBad::kNone) {
        before = from_dev(check_base, span, st);
        before_in = from_dev(in_base, in_span, st);
    }
    team.barrier();  // every member's input and poisoned output are in place before any peer reads or writes them

    TensorView tin(in, c.dt, {static_cast<int64_t>(in_elems)});
    TensorView tout(out, c.dt, {static_cast<int64_t>(out_elems)});
    if (c.bad != CollBad::kNone) {
        switch (c.bad) {
            case CollBad::kDtypeMismatch:
                tout.dtype = es == 2   ? (c.dt == DType::kBF16 ? DType::kF16 : DType::kBF16)
                             : es == 4 ? (c.dt == DType::kF32 ? DType::kI32 : DType::kF32)
                             : es == 1 ? (c.dt == DType::kU8 ? DType::kF8E4M3 : DType::kU8)
                                       : DType::kF32;
                break;
            case CollBad::kNotReducible:
                tin.dtype = tout.dtype = DType::kI32;
                break;
            case CollBad::kCountMismatch:
                tout = TensorView(out, c.dt, {static_cast<int64_t>(out_elems + 1)});
                break;
            case CollBad::kPartialOverlap:
                if (c.op == CollOp::kAllReduce) tout.data = static_cast<uint8_t*>(tin.data) + es;
                if (c.op == CollOp::kAllGather) tin.data = out + (static_cast<uint64_t>(me) * n + 1) * es;
                if (c.op == CollOp::kReduceScatter) tout.data = in + (static_cast<uint64_t>(me) * n + 1) * es;
                break;
            case CollBad::kMisaligned:
                tin.data = in + 1;
                break;
            case CollBad::kNotContiguous:
                tin = TensorView(in, c.dt, {static_cast<int64_t>(in_elems / 2)}, {2});
                if (c.op == CollOp::kAllGather)
                    tout = TensorView(out, c.dt, {static_cast<int64_t>(in_elems / 2 * unr)});
                if (c.op == CollOp::kReduceScatter)
                    tout = TensorView(out, c.dt, {static_cast<int64_t>(in_elems / 2 / unr)});
                if (c.op == CollOp::kReduceScatter && in_elems / 2 % unr != 0)
                    tin.shape[0] = static_cast<int64_t>(in_elems / 2 / unr * unr);
                if (c.op == CollOp::kAllReduce) tout = TensorView(out, c.dt, {static_cast<int64_t>(in_elems / 2)});
                break;
            default:
                break;
        }
    }
    const auto call = [&] {
        on_team(team, [&](auto& t) {
            switch (c.op) {
                case CollOp::kAllReduce:
                    ops::all_reduce(t, tin, tout, st, {.algo = static_cast<ops::AllReduceAlgo>(c.algo)});
                    break;
                case CollOp::kAllGather:
                    ops::all_gather(t, tin, tout, st, {.algo = static_cast<ops::AllGatherAlgo>(c.algo)});
                    break;
                case CollOp::kReduceScatter:
                    ops::reduce_scatter(t, tin, tout, st, {.algo = static_cast<ops::ReduceScatterAlgo>(c.algo)});
                    break;
            }
        });
    };
    if (c.bad != CollBad::kNone) {
        const std::string refused = expect_refused(coll_op_name(c.op), call);
        if (!refused.empty()) {
            try {
                team.world().sync_and_check(st);
            } catch (const std::exception& e) {
                return coll_bad_name(c.bad) + std::string(": ") + refused + "; then " + e.what();
            }
            return coll_bad_name(c.bad) + std::string(": ") + refused;
        }
        check_cuda(cudaStreamSynchronize(st), "after a refused call");
        check_cuda(cudaGetLastError(), "after a refused call");
        const std::vector<uint8_t> after = from_dev(check_base, span, st);
        if (after != before) return coll_bad_name(c.bad) + std::string(": a refused call wrote into the output");
        if (from_dev(in_base, in_span, st) != before_in) {
            return coll_bad_name(c.bad) + std::string(": a refused call wrote into the input's buffer");
        }
        return "";
    }
    call();
    team.world().sync_and_check(st);
    const std::vector<uint8_t> got = from_dev(check_base, span, st);
    const uint64_t lead = static_cast<uint64_t>(out - check_base);
    // Outside the output (and, in place, outside the input): the poison.
    if (!poison_intact(got.data(), lo)) return "wrote before the output";
    if (!poison_intact(got.data() + span - kGuard, kGuard)) return "wrote past the end";
    const uint8_t* g = got.data() + lead;
    switch (c.op) {
        case CollOp::kAllReduce:
        case CollOp::kReduceScatter: {
            const uint64_t first = c.op == CollOp::kReduceScatter ? static_cast<uint64_t>(me) * n : 0;
            for (uint64_t i = 0; i < n; ++i) {
                int32_t sum = 0;
                for (int q = 0; q < nr; ++q) sum += coll_value(seed, team.world_rank(q), first + i);
                const uint32_t want = int_bits(sum, c.dt);
                uint32_t have = 0;
                std::memcpy(&have, g + i * es, es);
                if (have != want) {
                    std::ostringstream os;
                    os << "element " << i << ": bits 0x" << std::hex << have << ", want 0x" << want << std::dec
                       << " (the sum " << sum << ")";
                    return os.str();
                }
            }
            break;
        }
        case CollOp::kAllGather:
            // Slot q holds team rank q's shard: world rank members()[q]'s bytes.
            for (int q = 0; q < nr; ++q) {
                const uint8_t* s = g + static_cast<uint64_t>(q) * n * es;
                for (uint64_t i = 0; i < n * es; ++i) {
                    if (s[i] != coll_byte(seed, team.world_rank(q), i)) {
                        return "byte " + std::to_string(i) + " of team rank " + std::to_string(q) +
                               "'s shard (world rank " + std::to_string(team.world_rank(q)) + ") is wrong";
                    }
                }
            }
            break;
    }
    return "";
}

// ---- all_to_all / all_to_all_v --------------------------------------------------------------------------------------

/// Byte i of what world rank src sends world rank dst in case `tag`.
inline uint8_t a2a_byte(uint64_t seed, uint64_t tag, int src, int dst, uint64_t i) {
    return static_cast<uint8_t>(mix64(seed ^ mix64(tag) ^ (uint64_t(src) << 48) ^ (uint64_t(dst) << 40) ^ i));
}

/// Invalid calls (all_to_all.hpp; weft::Error on the host before anything is launched), the same on every member.
enum class A2aBad {
    kNone,
    kDtypeMismatch,    // output in another dtype
    kOverlap,          // output overlapping the input
    kNotContiguous,    // a strided input
    kNotMultiple,      // all_to_all: a count that is not a multiple of the ranks (ranks >= 2)
    kCountMismatch,    // all_to_all: output's count not input's; all_to_all_v: input's not sum(send_counts)
    kCountsSize,       // all_to_all_v: send_counts with ranks + 1 entries
    kNegativeCount,    // all_to_all_v: a negative send count
    kSelfMismatch,     // all_to_all_v: recv_counts[rank] != send_counts[rank] (the output's size agrees)
    kStagingOverflow,  // all_to_all_v: a local input larger than the staging region (ranks >= 2)
    kCount
};
inline const char* a2a_bad_name(A2aBad b) {
    static const char* const kNames[] = {"none",          "dtype_mismatch",  "overlap",     "not_contiguous",
                                         "not_multiple",  "count_mismatch",  "counts_size", "negative_count",
                                         "self_mismatch", "staging_overflow"};
    return kNames[static_cast<int>(b)];
}

struct A2aCase {
    int world = 1;  // the team's ranks
    bool equal = false;
    DType dtype = DType::kBF16;
    std::vector<std::vector<int64_t>> counts;    // [src][dst] elements, team ranks
    std::vector<char> symmetric;                 // per team rank: input on the symmetric heap (read in place)
    std::vector<int64_t> in_offset, out_offset;  // per team rank, bytes (at times not multiples of the element size)
    const char* pattern = "";
    bool out_symmetric = false;  // the output on the symmetric heap (every member's)
    A2aBad bad = A2aBad::kNone;
    bool invalid() const { return bad != A2aBad::kNone; }
};

inline std::string describe(const A2aCase& c) {
    std::ostringstream os;
    os << "ranks=" << c.world << (c.equal ? " all_to_all" : " all_to_all_v") << " dtype=" << dtype_name(c.dtype)
       << " pattern=" << c.pattern << " symmetric=[";
    for (int q = 0; q < c.world; ++q) os << (q ? "," : "") << int{c.symmetric[static_cast<size_t>(q)]};
    os << "] in_offset=[";
    for (int q = 0; q < c.world; ++q) os << (q ? "," : "") << c.in_offset[static_cast<size_t>(q)];
    os << "] out_offset=[";
    for (int q = 0; q < c.world; ++q) os << (q ? "," : "") << c.out_offset[static_cast<size_t>(q)];
    os << "] counts=[";
    for (int s = 0; s < c.world; ++s) {
        os << (s ? ";" : "");
        for (int d = 0; d < c.world; ++d)
            os << (d ? "," : "") << c.counts[static_cast<size_t>(s)][static_cast<size_t>(d)];
    }
    os << "]";
    if (c.out_symmetric) os << " output symmetric";
    if (c.invalid()) os << " invalid=" << a2a_bad_name(c.bad);
    return os.str();
}

/// A case for a team of `world` ranks, each sending at most `max_bytes` in all (rounded to elements).
inline A2aCase draw_a2a(Rng& r, int world, int64_t max_bytes) {
    A2aCase c;
    c.world = world;
    c.equal = r.chance(0.2);
    c.dtype = r.pick({DType::kU8, DType::kBF16, DType::kF16, DType::kF32, DType::kI32, DType::kI64});
    const int64_t esize = dtype_bytes(c.dtype);
    const auto n = static_cast<size_t>(world);
    c.counts.assign(n, std::vector<int64_t>(n, 0));
    const int64_t max_per_pair = std::max<int64_t>(1, max_bytes / esize / world);
    const int pattern = static_cast<int>(r.uniform(0, 5));
    static const char* const kPatterns[] = {"random", "small", "sparse", "one_hot_pair", "silent_rank", "all_zero"};
    c.pattern = c.equal ? "equal" : kPatterns[pattern];
    const int64_t equal_count = r.chance(0.2) ? r.uniform(0, 17) : r.log_uniform(1, max_per_pair);
    const int hot_src = static_cast<int>(r.uniform(0, world - 1)), hot_dst = static_cast<int>(r.uniform(0, world - 1));
    for (int s = 0; s < world; ++s) {
        for (int d = 0; d < world; ++d) {
            int64_t& x = c.counts[static_cast<size_t>(s)][static_cast<size_t>(d)];
            if (c.equal) {
                x = equal_count;
                continue;
            }
            switch (pattern) {
                case 0:
                    x = r.chance(0.25) ? 0 : r.log_uniform(1, max_per_pair);
                    break;
                case 1:
                    x = r.uniform(0, 17);
                    break;
                case 2:
                    x = r.chance(0.8) ? 0 : r.log_uniform(1, max_per_pair);
                    break;
                case 3:
                    x = s == hot_src && d == hot_dst ? r.uniform(1, max_per_pair) : 0;
                    break;
                case 4:
                    x = s == hot_src ? 0 : r.uniform(0, 1000);
                    break;
                default:
                    break;
            }
        }
    }
    // all_to_all moves bytes from any device memory (all_to_all.hpp): now and then the views start at any byte, not
    // only at whole elements. Offsets stay below 16 elements either way.
    const int64_t unit = r.chance(0.15) ? 1 : esize;
    const auto offset = [&] { return unit * r.uniform(0, 16 * esize / unit - 1); };
    const int64_t sym_offset = offset();  // the same place in every rank's heap allocation
    // Symmetric inputs on every rank or on none (collectives.hpp): ranks that differ make different calls, which the
    // op refuses as a call mismatch.
    const bool sym = r.chance(0.4);
    for (int q = 0; q < world; ++q) {
        c.symmetric.push_back(sym ? 1 : 0);
        c.in_offset.push_back(sym ? sym_offset : offset());
        c.out_offset.push_back(offset());
    }
    return c;
}

/// Makes `c` an invalid case of a kind that applies to it, with probability `p` (else `c` stays valid). A staging
/// overflow resizes the counts so that every member's local input passes `staging_bytes` (the buffers must hold it).
inline void draw_a2a_bad(Rng& r, A2aCase& c, uint64_t staging_bytes, double p) {
    if (!r.chance(p)) return;
    const auto n = static_cast<size_t>(c.world);
    c.bad = static_cast<A2aBad>(r.uniform(1, static_cast<int>(A2aBad::kCount) - 1));
    if (c.equal && c.bad >= A2aBad::kCountsSize) c.bad = A2aBad::kCountMismatch;  // the kinds of all_to_all_v only
    if (c.bad == A2aBad::kNotMultiple && (!c.equal || c.world == 1)) c.bad = A2aBad::kDtypeMismatch;
    if (c.bad == A2aBad::kStagingOverflow && c.world == 1) c.bad = A2aBad::kNegativeCount;  // one rank: a copy
    if (c.bad == A2aBad::kStagingOverflow) {
        const auto esize = static_cast<uint64_t>(dtype_bytes(c.dtype));
        const auto per_pair = static_cast<int64_t>(staging_bytes / esize / n + 1);
        for (auto& row : c.counts) std::fill(row.begin(), row.end(), per_pair);
        std::fill(c.symmetric.begin(), c.symmetric.end(), 0);
        c.pattern = "staging_overflow";
    }
    // Room for a strided view of twice the input's extent in the input's buffer.
    if (c.bad == A2aBad::kNotContiguous) {
        for (auto& row : c.counts) {
            for (int64_t& x : row) x = std::min<int64_t>(x, 64);
        }
    }
}

/// The valid call an invalid case stands for.
inline A2aCase valid_twin(A2aCase c) {
    if (c.bad == A2aBad::kStagingOverflow) {  // too big to stage: from the symmetric heap, one place on every member
        std::fill(c.symmetric.begin(), c.symmetric.end(), 1);
        std::fill(c.in_offset.begin(), c.in_offset.end(), c.in_offset[0]);
    }
    c.bad = A2aBad::kNone;
    return c;
}

/// Team rank `me`'s arguments of a case's call: the input and output views at `in` and `out`, and the counts, made
/// invalid as c.bad says. Pure (no CUDA call).
struct A2aArgs {
    TensorView input, output;
    std::vector<int64_t> send, recv;
};
inline A2aArgs a2a_args(const A2aCase& c, int me, uint8_t* in, uint8_t* out) {
    const int nr = c.world;
    const auto esize = static_cast<uint64_t>(dtype_bytes(c.dtype));
    A2aArgs a;
    int64_t send_elems = 0, recv_elems = 0;
    for (int q = 0; q < nr; ++q) {
        a.send.push_back(c.counts[static_cast<size_t>(me)][static_cast<size_t>(q)]);
        a.recv.push_back(c.counts[static_cast<size_t>(q)][static_cast<size_t>(me)]);
        send_elems += a.send.back();
        recv_elems += a.recv.back();
    }
    a.input = TensorView(in, c.dtype, {send_elems});
    a.output = TensorView(out, c.dtype, {recv_elems});
    switch (c.bad) {
        case A2aBad::kDtypeMismatch:  // refused before the sizes are looked at
            a.output.dtype = c.dtype == DType::kF32 ? DType::kI32 : DType::kF32;
            break;
        case A2aBad::kOverlap:  // both views non-empty, the output one element into the input
            a.input.shape[0] = std::max<int64_t>(send_elems, 2);
            a.output = TensorView(in + esize, c.dtype, {std::max<int64_t>(recv_elems, 2)});
            break;
        case A2aBad::kNotContiguous:  // within the input's buffer: draw_a2a_bad bounds the counts
            a.input = TensorView(in, c.dtype, {std::max<int64_t>(send_elems, 2)}, {2});
            break;
        case A2aBad::kNotMultiple:
            a.input.shape[0] += 1;
            a.output.shape[0] += 1;
            break;
        case A2aBad::kCountMismatch:
            if (c.equal) {
                a.output.shape[0] += nr;
            } else {
                a.input.shape[0] += 1;
            }
            break;
        case A2aBad::kCountsSize:
            a.send.push_back(0);
            break;
        case A2aBad::kNegativeCount:
            a.send[static_cast<size_t>((me + 1) % nr)] = -1;
            break;
        case A2aBad::kSelfMismatch:
            a.recv[static_cast<size_t>(me)] += 1;
            a.output.shape[0] += 1;
            break;
        default:
            break;
    }
    return a;
}

/// Runs a case on `team` (every member calls it; c.world == team.num_ranks()) from `b` and checks this member's
/// output: "" or what went wrong. Byte i of what team rank s sends team rank d is a2a_byte(seed, tag, s's world rank,
/// d's world rank, i). The output's buffer is poisoned whole and must stay so outside the output (an invalid case:
/// everywhere).
inline std::string run_a2a(const A2aCase& c, uint64_t seed, uint64_t tag, const Team& team, const CollBuffers& b,
                           cudaStream_t st) {
    const int nr = c.world, me = team.rank(), my_world = team.world_rank(me);
    const auto esize = static_cast<uint64_t>(dtype_bytes(c.dtype));
    const auto& sends = c.counts[static_cast<size_t>(me)];
    std::vector<uint8_t> in_host;
    for (int q = 0; q < nr; ++q) {
        for (uint64_t i = 0; i < static_cast<uint64_t>(sends[static_cast<size_t>(q)]) * esize; ++i) {
            in_host.push_back(a2a_byte(seed, tag, my_world, team.world_rank(q), i));
        }
    }
    uint8_t* const in_buffer = c.symmetric[static_cast<size_t>(me)] ? b.sym_in : b.local_in;
    uint8_t* in = in_buffer + c.in_offset[static_cast<size_t>(me)];
    uint8_t* const out_base = c.out_symmetric ? b.sym_out : b.local_out;
    const uint64_t lead = static_cast<uint64_t>(c.out_offset[static_cast<size_t>(me)]);
    to_dev(in, in_host.data(), in_host.size(), st);
    check_cuda(cudaMemsetAsync(out_base, 0xFF, b.capacity, st), "poison");
    check_cuda(cudaStreamSynchronize(st), "poison");
    // A refused call writes nothing, also not into the input's buffer (an overlapping invalid output points there).
    const uint64_t in_span =
        std::min<uint64_t>(in_host.size() + kGuard, b.capacity - static_cast<uint64_t>(in - in_buffer));
    std::vector<uint8_t> before_in;
    if (c.invalid()) before_in = from_dev(in, in_span, st);
    team.barrier();  // every member's input is in place before a peer reads it

    const A2aArgs a = a2a_args(c, me, in, out_base + lead);
    const char* op = c.equal ? "all_to_all" : "all_to_all_v";
    const auto call = [&] {
        on_team(team, [&](auto& t) {
            if (c.equal) {
                ops::all_to_all(t, a.input, a.output, st);
            } else {
                ops::all_to_all_v(t, a.input, a.send, a.output, a.recv, st);
            }
        });
    };
    if (c.invalid()) {
        std::string what = expect_refused(op, call);
        check_cuda(cudaStreamSynchronize(st), "after a refused call");
        check_cuda(cudaGetLastError(), "after a refused call");
        if (what.empty() && !poison_intact(from_dev(out_base, b.capacity, st).data(), b.capacity))
            what = "a refused call wrote into the output";
        if (what.empty() && from_dev(in, in_span, st) != before_in)
            what = "a refused call wrote into the input's buffer";
        return what.empty() ? "" : a2a_bad_name(c.bad) + std::string(": ") + what;
    }
    try {
        call();
        team.world().sync_and_check(st);
    } catch (const std::exception& e) {
        return std::string("threw: ") + e.what();
    }
    const uint64_t out_bytes = static_cast<uint64_t>(a.output.size_bytes());
    const std::vector<uint8_t> got = from_dev(out_base, b.capacity, st);
    uint64_t pos = lead;
    for (int q = 0; q < nr; ++q) {  // chunk q comes from team rank q: world rank members()[q]
        const uint64_t bytes = static_cast<uint64_t>(a.recv[static_cast<size_t>(q)]) * esize;
        for (uint64_t i = 0; i < bytes; ++i) {
            if (got[pos + i] != a2a_byte(seed, tag, team.world_rank(q), my_world, i)) {
                return "byte " + std::to_string(i) + " of the chunk from team rank " + std::to_string(q) +
                       " (world rank " + std::to_string(team.world_rank(q)) + ") is wrong";
            }
        }
        pos += bytes;
    }
    if (!poison_intact(got.data(), lead)) return "wrote before the output";
    if (!poison_intact(got.data() + lead + out_bytes, b.capacity - lead - out_bytes))
        return "wrote past the output's end";
    return "";
}

}  // namespace weft::fuzz_test
