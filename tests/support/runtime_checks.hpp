// SPDX-License-Identifier: MIT
// Rank-level runtime checks shared by the gpu tier (ranks as threads) and the dist tier (processes).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#ifdef __CUDACC__
#define WEFT_TEST_HD __host__ __device__
#else
#define WEFT_TEST_HD
#endif

namespace weft {
class World;
struct WorldOptions;
}  // namespace weft

namespace weft::test {

/// The value rank `src` writes at element i of its slot in rank `dst`'s buffer (world ranks).
WEFT_TEST_HD inline uint32_t exchange_pattern(int src, int dst, uint64_t i) {
    return static_cast<uint32_t>(src) * 1000003u + static_cast<uint32_t>(dst) * 7919u + static_cast<uint32_t>(i);
}

/// For death-test children that provoke a failure: runs `call`; if it throws, stores how many seconds it ran in
/// `*seconds` (when not null) and rethrows.
void time_failure(const std::function<void()>& call, double* seconds);

/// Ends a death-test child: prints "error after S s: <message>" and, when `ok`, "the error named the missing rank"
/// (what the parent's EXPECT_EXIT matches), then exits with 0 (ok) or 1. `skip_destructors` leaves with _Exit: a
/// kernel that trapped has lost the process's CUDA context, and static destructors would call into it.
[[noreturn]] void exit_with_fault_report(const std::string& message, double seconds, bool ok, bool skip_destructors);

/// Small heaps (8 ranks may share one GPU) and a generous timeout.
WorldOptions test_options(uint64_t heap_bytes = 64ull << 20);

/// Runs `fn` on `num_ranks` ranks (as threads) and returns each rank's weft::Error text, empty where `fn` returned, in
/// rank order; the ranks meet at a barrier after `fn`.
std::vector<std::string> error_of_each_rank(int num_ranks, const std::function<void(World&)>& fn);

/// run_local that turns an exception into a test failure carrying its message.
void run_ranks(int num_ranks, const std::function<void(World&)>& fn);
void run_ranks(int num_ranks, const std::function<void(World&)>& fn, const WorldOptions& options);

// Each check is collective (every rank calls it) and throws weft::Error naming the rank and what was wrong.

/// Every rank poisons a buffer, writes exchange_pattern(me, d, i) into its slot of every peer's buffer with
/// cudaMemcpy to the address symm_at gives, and after a barrier verifies the slots of every peer.
void check_exchange_through_symm_at(World& w, uint64_t count);
/// A random sequence of collective allocs and frees (seed chosen by rank 0): alignment, containment, and the
/// same offsets on every rank; everything freed at the end.
void check_alloc_free_cycles(World& w, int steps);
/// Mismatched sizes, alignments and alloc-vs-free calls are errors on this rank, naming the ranks and what
/// each asked; matching calls work afterwards. Needs at least 2 ranks.
void check_mismatch_errors(World& w);
/// alloc_signals returns zeroed words even where a freed, dirty allocation was.
void check_alloc_signals_zeroed(World& w);
/// stream_write_u32/u64 through symm_at reach every peer's heap; waits on the written values pass.
void check_stream_writes_to_peers(World& w);

}  // namespace weft::test
