// SPDX-License-Identifier: MIT
// GPU tests of the collectives (ranks as threads sharing the visible GPUs): exact results against a CPU reference
// for every algorithm (LL reduce-scatter included), dtype, world size 1-8, size (1 element to tens of MB) and buffer
// placement; a stress loop of thousands of back-to-back calls with stragglers and no host synchronisation; CUDA
// graph capture and replay.
//
// Inputs are integers in [-8, 8] (collectives_test_kernels.hpp), so every sum is exact in bf16, f16 and f32 and
// the outputs must match bit for bit. Outputs are poisoned (0xFF bytes: NaN) before every call, and the bytes
// just outside them are checked to be untouched. The seed is printed; WEFT_TEST_SEED=<n> replays a run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/collectives_test_kernels.hpp"
#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

using ops::AllGatherAlgo;
using ops::AllReduceAlgo;
using ops::ReduceScatterAlgo;

constexpr DType kReduceTypes[] = {DType::kBF16, DType::kF16, DType::kF32};
constexpr DType kGatherTypes[] = {DType::kU8, DType::kBF16, DType::kF32};
constexpr AllReduceAlgo kAllReduceAlgos[] = {AllReduceAlgo::kAuto, AllReduceAlgo::kLowLatency, AllReduceAlgo::kOneShot,
                                             AllReduceAlgo::kTwoShot};
constexpr AllGatherAlgo kAllGatherAlgos[] = {AllGatherAlgo::kAuto, AllGatherAlgo::kLowLatency, AllGatherAlgo::kSmPush,
                                             AllGatherAlgo::kCopyEnginePull, AllGatherAlgo::kCopyEnginePush};
constexpr ReduceScatterAlgo kReduceScatterAlgos[] = {ReduceScatterAlgo::kAuto, ReduceScatterAlgo::kSmPull,
                                                     ReduceScatterAlgo::kLowLatency};
// Element counts: 1, around vector and granule boundaries, odd, and past the LL capacity (rounds).
constexpr uint64_t kCounts[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 100, 1000, 4099, 65537, 300007};
constexpr uint64_t kBigBytes = 24ull << 20;  // "tens of MB": one case per op and algorithm, worlds 3 and 8
constexpr uint64_t kGuardBytes = 64;

uint64_t test_seed() {
    static const uint64_t seed = [] {
        const std::optional<int64_t> fixed = env::get_int("WEFT_TEST_SEED");
        const uint64_t s =
            fixed ? static_cast<uint64_t>(*fixed) : (uint64_t{std::random_device{}()} << 20) ^ std::random_device{}();
        std::printf("[ seed     ] WEFT_TEST_SEED=%llu\n", static_cast<unsigned long long>(s));
        return s;
    }();
    return seed;
}

// Where a case's buffers live. Symmetric placements use the symmetric heap (peers may read/write in place).
enum class Place { kLocal, kLocalInPlace, kSymmetric, kSymmetricInPlace, kMisaligned, kMixed };
constexpr Place kPlaces[] = {Place::kLocal,      Place::kLocalInPlace, Place::kSymmetric, Place::kSymmetricInPlace,
                             Place::kMisaligned, Place::kMixed};

const char* place_name(Place p) {
    switch (p) {
        case Place::kLocal:
            return "local";
        case Place::kLocalInPlace:
            return "local in-place";
        case Place::kSymmetric:
            return "symmetric";
        case Place::kSymmetricInPlace:
            return "symmetric in-place";
        case Place::kMisaligned:
            return "local misaligned";
        case Place::kMixed:
            return "local in, symmetric out";
    }
    return "?";
}

bool in_place(Place p) { return p == Place::kLocalInPlace || p == Place::kSymmetricInPlace; }
bool output_symmetric(Place p) { return p == Place::kSymmetric || p == Place::kSymmetricInPlace || p == Place::kMixed; }

// One rank's buffers for a whole world's worth of cases: allocated once (collectively), freed after a barrier, so
// that no allocation or free runs while another rank's collective kernel waits for this one (and stream-ordered:
// cudaMalloc/cudaFree may synchronise the whole device).
class RankBuffers {
public:
    RankBuffers(World& w, uint64_t capacity) : w_(w), capacity_(capacity + 2 * kGuardBytes) {
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&local_in_), capacity_, stream_));
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&local_out_), capacity_, stream_));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        sym_in_ = static_cast<uint8_t*>(w.heap().alloc(capacity_));
        sym_out_ = static_cast<uint8_t*>(w.heap().alloc(capacity_));
        ops::prepare_collectives(w);
        w.barrier();
    }
    RankBuffers(const RankBuffers&) = delete;
    RankBuffers& operator=(const RankBuffers&) = delete;
    ~RankBuffers() {
        cudaStreamSynchronize(stream_);
        cudaStreamDestroy(stream_);
    }
    // Collective: every rank's work is done before anything is freed.
    void release() {
        w_.sync_and_check(stream_);
        w_.barrier();
        w_.heap().free(sym_out_);
        w_.heap().free(sym_in_);
        cudaFreeAsync(local_out_, stream_);
        cudaFreeAsync(local_in_, stream_);
        cudaStreamSynchronize(stream_);
    }

    World& world() { return w_; }
    cudaStream_t stream() const { return stream_; }
    uint64_t capacity() const { return capacity_ - 2 * kGuardBytes; }
    // Base of a placement's input and output allocations (the guard band starts them).
    uint8_t* in_base(Place p) const {
        return p == Place::kSymmetric || p == Place::kSymmetricInPlace ? sym_in_ : local_in_;
    }
    uint8_t* out_base(Place p) const {
        switch (p) {
            case Place::kLocal:
            case Place::kMisaligned:
                return local_out_;
            case Place::kLocalInPlace:
                return local_in_;
            case Place::kSymmetric:
                return sym_out_;
            case Place::kSymmetricInPlace:
                return sym_in_;
            case Place::kMixed:
                return sym_out_;
        }
        return nullptr;
    }
    // Data starts kGuardBytes in (plus one element when misaligned: aligned to the element, not to 16 bytes).
    uint64_t lead(Place p, DType t) const {
        return kGuardBytes + (p == Place::kMisaligned ? static_cast<uint64_t>(dtype_bytes(t)) : 0);
    }

private:
    World& w_;
    uint64_t capacity_;
    cudaStream_t stream_ = nullptr;
    uint8_t* local_in_ = nullptr;
    uint8_t* local_out_ = nullptr;
    uint8_t* sym_in_ = nullptr;
    uint8_t* sym_out_ = nullptr;
};

std::vector<uint8_t> download(cudaStream_t s, const uint8_t* p, uint64_t bytes) {
    std::vector<uint8_t> h(bytes);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(h.data(), p, bytes, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    return h;
}

uint32_t bits_at(const std::vector<uint8_t>& h, uint64_t byte_offset, int elem_bytes) {
    uint32_t v = 0;
    std::memcpy(&v, h.data() + byte_offset, static_cast<size_t>(elem_bytes));
    return v;
}

// Compares `count` elements of the downloaded region (which starts `lead` bytes before the data and extends
// kGuardBytes past it) with expected(i), and the guard bytes with the poison. Returns "" or a description.
template <class Expected>
std::string compare(const std::vector<uint8_t>& h, uint64_t lead, uint64_t count, DType t, bool guarded,
                    const Expected& expected) {
    const int es = dtype_bytes(t);
    uint64_t bad = 0;
    std::ostringstream first;
    for (uint64_t i = 0; i < count; ++i) {
        const uint32_t got = bits_at(h, lead + i * static_cast<uint64_t>(es), es);
        const uint32_t want = expected(i);
        if (got != want) {
            if (bad == 0)
                first << "element " << i << ": got 0x" << std::hex << got << ", expected 0x" << want << std::dec;
            ++bad;
        }
    }
    if (guarded) {
        for (uint64_t k = 0; k < lead; ++k) {
            if (h[k] != 0xFF) return "byte " + std::to_string(lead - k) + " before the output was overwritten";
        }
        for (uint64_t k = lead + count * static_cast<uint64_t>(es); k < h.size(); ++k) {
            if (h[k] != 0xFF)
                return "byte " + std::to_string(k - lead - count * es) + " after the output was overwritten";
        }
    }
    if (bad == 0) return "";
    return std::to_string(bad) + " of " + std::to_string(count) + " elements wrong; first " + first.str();
}

// Sum over ranks of pattern_value(seed, r, offset + i), cached per (seed, ranks, offset, count): the big cases
// reuse one reference across algorithms and placements.
const std::vector<int32_t>& reference_sums(uint64_t seed, int num_ranks, uint64_t offset, uint64_t count) {
    thread_local std::map<std::tuple<uint64_t, int, uint64_t, uint64_t>, std::vector<int32_t>> cache;
    auto key = std::make_tuple(seed, num_ranks, offset, count);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    if (cache.size() > 8) cache.clear();
    std::vector<int32_t> sums(count, 0);
    for (int r = 0; r < num_ranks; ++r) {
        for (uint64_t i = 0; i < count; ++i) sums[i] += pattern_value(seed, r, offset + i);
    }
    return cache.emplace(key, std::move(sums)).first->second;
}

std::string describe(const char* op, const char* algo, DType t, uint64_t count, Place p, int rank, int n) {
    std::ostringstream os;
    os << op << " " << algo << " " << dtype_name(t) << " count " << count << " " << place_name(p) << " (rank " << rank
       << " of " << n << ")";
    return os.str();
}

// ------------------------------------------------------------------------------------------------
// One case of each op: poison, fill, run, download, compare with the CPU reference.

void all_reduce_case(RankBuffers& b, DType t, AllReduceAlgo algo, uint64_t count, Place p, uint64_t seed,
                     std::vector<std::string>* failures) {
    World& w = b.world();
    const uint64_t es = static_cast<uint64_t>(dtype_bytes(t));
    const uint64_t lead = b.lead(p, t);
    uint8_t* in = b.in_base(p) + lead;
    uint8_t* out = b.out_base(p) + lead;
    const uint64_t span = lead + count * es + kGuardBytes;
    WEFT_CUDA_CHECK(cudaMemsetAsync(b.out_base(p), 0xFF, span, b.stream()));
    launch_fill_pattern(b.stream(), in, t, count, seed, w.rank(), 0);
    ops::all_reduce(w, TensorView(in, t, {static_cast<int64_t>(count)}),
                    TensorView(out, t, {static_cast<int64_t>(count)}), b.stream(), {.algo = algo});
    w.sync_and_check(b.stream());
    const std::vector<uint8_t> h = download(b.stream(), b.out_base(p), span);
    const std::vector<int32_t>& sums = reference_sums(seed, w.num_ranks(), 0, count);
    const std::string err = compare(h, lead, count, t, !in_place(p), [&](uint64_t i) { return int_bits(sums[i], t); });
    if (!err.empty())
        failures->push_back(describe("all_reduce", ops::algo_name(algo), t, count, p, w.rank(), w.num_ranks()) + ": " +
                            err);
}

void all_gather_case(RankBuffers& b, DType t, AllGatherAlgo algo, uint64_t count, Place p, uint64_t seed,
                     std::vector<std::string>* failures) {
    World& w = b.world();
    const int n = w.num_ranks();
    const uint64_t es = static_cast<uint64_t>(dtype_bytes(t));
    const uint64_t lead = b.lead(p, t);
    uint8_t* out = b.out_base(p) + lead;
    uint8_t* in = in_place(p) ? out + static_cast<uint64_t>(w.rank()) * count * es : b.in_base(p) + lead;
    const uint64_t total = count * static_cast<uint64_t>(n);
    const uint64_t span = lead + total * es + kGuardBytes;
    WEFT_CUDA_CHECK(cudaMemsetAsync(b.out_base(p), 0xFF, span, b.stream()));
    launch_fill_pattern(b.stream(), in, t, count, seed, w.rank(), 0);
    ops::all_gather(w, TensorView(in, t, {static_cast<int64_t>(count)}),
                    TensorView(out, t, {static_cast<int64_t>(total)}), b.stream(), {.algo = algo});
    w.sync_and_check(b.stream());
    const std::vector<uint8_t> h = download(b.stream(), b.out_base(p), span);
    const std::string err = compare(h, lead, total, t, true, [&](uint64_t k) {
        return int_bits(pattern_value(seed, static_cast<int>(k / count), k % count), t);
    });
    if (!err.empty())
        failures->push_back(describe("all_gather", ops::algo_name(algo), t, count, p, w.rank(), n) + ": " + err);
}

void reduce_scatter_case(RankBuffers& b, DType t, ReduceScatterAlgo algo, uint64_t count, Place p, uint64_t seed,
                         std::vector<std::string>* failures) {
    World& w = b.world();
    const int n = w.num_ranks();
    const uint64_t es = static_cast<uint64_t>(dtype_bytes(t));
    const uint64_t lead = b.lead(p, t);
    const uint64_t total = count * static_cast<uint64_t>(n);
    uint8_t* in = b.in_base(p) + lead;
    uint8_t* out = in_place(p) ? in + static_cast<uint64_t>(w.rank()) * count * es : b.out_base(p) + lead;
    uint8_t* region = in_place(p) ? out : b.out_base(p);  // what is downloaded (in place: just the slice)
    const uint64_t region_lead = in_place(p) ? 0 : lead;
    const uint64_t span = in_place(p) ? count * es : lead + count * es + kGuardBytes;
    if (!in_place(p)) WEFT_CUDA_CHECK(cudaMemsetAsync(b.out_base(p), 0xFF, span, b.stream()));
    launch_fill_pattern(b.stream(), in, t, total, seed, w.rank(), 0);
    ops::reduce_scatter(w, TensorView(in, t, {static_cast<int64_t>(total)}),
                        TensorView(out, t, {static_cast<int64_t>(count)}), b.stream(), {.algo = algo});
    w.sync_and_check(b.stream());
    const std::vector<uint8_t> h = download(b.stream(), region, span);
    const std::vector<int32_t>& sums = reference_sums(seed, n, static_cast<uint64_t>(w.rank()) * count, count);
    const std::string err =
        compare(h, region_lead, count, t, !in_place(p), [&](uint64_t i) { return int_bits(sums[i], t); });
    if (!err.empty())
        failures->push_back(describe("reduce_scatter", ops::algo_name(algo), t, count, p, w.rank(), n) + ": " + err);
}

void report(const std::vector<std::string>& failures) {
    for (size_t i = 0; i < failures.size() && i < 20; ++i) ADD_FAILURE() << failures[i];
    if (failures.size() > 20) ADD_FAILURE() << "... and " << failures.size() - 20 << " more failures";
}

WorldOptions sweep_options() { return test_options(128ull << 20); }

// Small staging regions make the staged algorithms run in several rounds already at a few hundred thousand
// elements (the big cases run dozens).
testing::ScopedEnv small_staging() { return testing::ScopedEnv("WEFT_COLLECTIVE_STAGING_BYTES", std::string("1M")); }

// ------------------------------------------------------------------------------------------------

TEST(Collectives, AllReduceEveryAlgorithmDtypeSizePlacementAndWorld) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const uint64_t seed = test_seed();
    const auto staging = small_staging();
    for (int n = 1; n <= 8; ++n) {
        SCOPED_TRACE("world " + std::to_string(n));
        run_ranks(
            n,
            [&](World& w) {
                RankBuffers b(w, kBigBytes);
                std::vector<std::string> failures;
                for (DType t : kReduceTypes) {
                    for (AllReduceAlgo a : kAllReduceAlgos) {
                        for (uint64_t count : kCounts) {
                            for (Place p : kPlaces) all_reduce_case(b, t, a, count, p, seed ^ count, &failures);
                        }
                    }
                }
                if (n == 3 || n == 8) {
                    const uint64_t big = kBigBytes / 2 - 3;  // bf16 elements, odd
                    for (AllReduceAlgo a : kAllReduceAlgos) {
                        for (Place p : {Place::kLocal, Place::kSymmetric})
                            all_reduce_case(b, DType::kBF16, a, big, p, seed, &failures);
                    }
                }
                report(failures);
                b.release();
            },
            sweep_options());
    }
}

TEST(Collectives, AllGatherEveryAlgorithmDtypeSizePlacementAndWorld) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const uint64_t seed = test_seed();
    const auto staging = small_staging();
    for (int n = 1; n <= 8; ++n) {
        SCOPED_TRACE("world " + std::to_string(n));
        run_ranks(
            n,
            [&](World& w) {
                RankBuffers b(w, kBigBytes);
                std::vector<std::string> failures;
                for (DType t : kGatherTypes) {
                    for (AllGatherAlgo a : kAllGatherAlgos) {
                        const bool push = a == AllGatherAlgo::kSmPush || a == AllGatherAlgo::kCopyEnginePush;
                        for (uint64_t count : kCounts) {
                            if (count * static_cast<uint64_t>(n * dtype_bytes(t)) > b.capacity() - 64) continue;
                            for (Place p : kPlaces) {
                                if (push && !output_symmetric(p)) continue;  // rejected: see AllGatherErrors
                                all_gather_case(b, t, a, count, p, seed ^ count, &failures);
                            }
                        }
                    }
                }
                if (n == 3 || n == 8) {
                    const uint64_t shard = kBigBytes / static_cast<uint64_t>(n) / 4 - 1;  // f32 elements
                    for (AllGatherAlgo a : kAllGatherAlgos) {
                        all_gather_case(b, DType::kF32, a, shard, Place::kSymmetric, seed, &failures);
                        if (a != AllGatherAlgo::kSmPush && a != AllGatherAlgo::kCopyEnginePush) {
                            all_gather_case(b, DType::kF32, a, shard, Place::kLocal, seed, &failures);
                        }
                    }
                }
                report(failures);
                b.release();
            },
            sweep_options());
    }
}

TEST(Collectives, ReduceScatterEveryAlgorithmDtypeSizePlacementAndWorld) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const uint64_t seed = test_seed();
    const auto staging = small_staging();
    for (int n = 1; n <= 8; ++n) {
        SCOPED_TRACE("world " + std::to_string(n));
        run_ranks(
            n,
            [&](World& w) {
                RankBuffers b(w, kBigBytes);
                std::vector<std::string> failures;
                for (DType t : kReduceTypes) {
                    for (ReduceScatterAlgo a : kReduceScatterAlgos) {
                        for (uint64_t count : kCounts) {
                            if (count * static_cast<uint64_t>(n * dtype_bytes(t)) > b.capacity() - 64) continue;
                            for (Place p : kPlaces) reduce_scatter_case(b, t, a, count, p, seed ^ count, &failures);
                        }
                    }
                }
                if (n == 3 || n == 8) {
                    const uint64_t count = kBigBytes / static_cast<uint64_t>(n) / 2 - 5;  // bf16 elements per rank
                    for (ReduceScatterAlgo a : {ReduceScatterAlgo::kSmPull, ReduceScatterAlgo::kLowLatency}) {
                        for (Place p : {Place::kLocal, Place::kSymmetric}) {
                            reduce_scatter_case(b, DType::kBF16, a, count, p, seed, &failures);  // LL: dozens of rounds
                        }
                    }
                }
                report(failures);
                b.release();
            },
            sweep_options());
    }
}

// ------------------------------------------------------------------------------------------------
// Stress: thousands of back-to-back calls, random ops, algorithms, dtypes, sizes and placements (the same on
// every rank: one shared seed), stragglers (a delay kernel before the call on random ranks), no host
// synchronisation until the end. A device kernel checks each call's output right after it, into its own slot.

enum class Op { kAllReduce, kAllGather, kReduceScatter };

struct StressCall {
    Op op;
    DType dtype;
    int algo;
    uint64_t count;
    bool in_sym;
    bool out_sym;
    bool inplace;
};

std::string describe(const StressCall& c, int index) {
    std::ostringstream os;
    const char* op = c.op == Op::kAllReduce ? "all_reduce" : c.op == Op::kAllGather ? "all_gather" : "reduce_scatter";
    const char* algo = c.op == Op::kAllReduce   ? ops::algo_name(static_cast<AllReduceAlgo>(c.algo))
                       : c.op == Op::kAllGather ? ops::algo_name(static_cast<AllGatherAlgo>(c.algo))
                                                : ops::algo_name(static_cast<ReduceScatterAlgo>(c.algo));
    os << "call " << index << ": " << op << " " << algo << " " << dtype_name(c.dtype) << " count " << c.count
       << (c.in_sym ? " in:symmetric" : " in:local") << (c.out_sym ? " out:symmetric" : " out:local")
       << (c.inplace ? " in-place" : "");
    return os.str();
}

std::vector<StressCall> stress_plan(uint64_t seed, int num_calls, uint64_t max_count) {
    std::mt19937_64 rng(seed);
    std::vector<StressCall> calls;
    for (int k = 0; k < num_calls; ++k) {
        StressCall c{};
        c.op = static_cast<Op>(rng() % 3);
        c.dtype = c.op == Op::kAllGather ? kGatherTypes[rng() % 3] : kReduceTypes[rng() % 3];
        // Mostly small messages (the latency paths), some large (bandwidth paths and rounds).
        const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
        c.count = std::max<uint64_t>(1, static_cast<uint64_t>(std::pow(static_cast<double>(max_count), u * u)));
        c.in_sym = rng() % 2 == 0;
        c.out_sym = rng() % 2 == 0;
        c.inplace = rng() % 4 == 0;
        if (c.op == Op::kAllReduce) c.algo = static_cast<int>(kAllReduceAlgos[rng() % std::size(kAllReduceAlgos)]);
        if (c.op == Op::kReduceScatter) {
            c.algo = static_cast<int>(kReduceScatterAlgos[rng() % std::size(kReduceScatterAlgos)]);
        }
        if (c.op == Op::kAllGather) {
            c.algo = static_cast<int>(kAllGatherAlgos[rng() % std::size(kAllGatherAlgos)]);
            const auto a = static_cast<AllGatherAlgo>(c.algo);
            if (a == AllGatherAlgo::kSmPush || a == AllGatherAlgo::kCopyEnginePush) c.out_sym = true;
        }
        if (c.inplace) c.in_sym = c.out_sym;  // one buffer
        calls.push_back(c);
    }
    return calls;
}

void run_stress(int num_ranks, int num_calls, uint64_t seed) {
    const uint64_t max_count = 1 << 18;
    const std::vector<StressCall> plan = stress_plan(seed, num_calls, max_count);
    const uint64_t capacity = max_count * 4 * static_cast<uint64_t>(num_ranks);
    run_ranks(
        num_ranks,
        [&](World& w) {
            RankBuffers b(w, capacity);
            unsigned long long* errors = nullptr;
            WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&errors), sizeof(unsigned long long) * plan.size(),
                                            b.stream()));
            WEFT_CUDA_CHECK(cudaMemsetAsync(errors, 0, sizeof(unsigned long long) * plan.size(), b.stream()));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(b.stream()));
            w.barrier();
            std::mt19937_64 straggle(seed * 31 + static_cast<uint64_t>(w.rank()));  // per-rank delays
            const int me = w.rank();
            const int n = w.num_ranks();
            cudaStream_t s = b.stream();
            for (size_t k = 0; k < plan.size(); ++k) {
                const StressCall& c = plan[k];
                const uint64_t es = static_cast<uint64_t>(dtype_bytes(c.dtype));
                const uint64_t call_seed = seed + k * 0x9e37ull;
                const Place in_place_kind = c.in_sym ? Place::kSymmetric : Place::kLocal;
                const Place out_place_kind = c.out_sym ? Place::kSymmetric : Place::kLocal;
                uint8_t* inb = b.in_base(in_place_kind) + kGuardBytes;
                uint8_t* outb = c.inplace ? inb : b.out_base(out_place_kind) + kGuardBytes;
                unsigned long long* err = errors + k;
                if (straggle() % 3 == 0) launch_delay(s, straggle() % 40000);
                const auto count = static_cast<int64_t>(c.count);
                const auto total = static_cast<int64_t>(c.count * static_cast<uint64_t>(n));
                switch (c.op) {
                    case Op::kAllReduce:
                        if (!c.inplace) WEFT_CUDA_CHECK(cudaMemsetAsync(outb, 0xFF, c.count * es, s));
                        launch_fill_pattern(s, inb, c.dtype, c.count, call_seed, me, 0);
                        ops::all_reduce(w, TensorView(inb, c.dtype, {count}), TensorView(outb, c.dtype, {count}), s,
                                        {.algo = static_cast<AllReduceAlgo>(c.algo)});
                        launch_check_sum(s, outb, c.dtype, c.count, call_seed, n, 0, err);
                        break;
                    case Op::kAllGather: {
                        uint8_t* in = c.inplace ? outb + static_cast<uint64_t>(me) * c.count * es : inb;
                        WEFT_CUDA_CHECK(cudaMemsetAsync(outb, 0xFF, c.count * es * static_cast<uint64_t>(n), s));
                        launch_fill_pattern(s, in, c.dtype, c.count, call_seed, me, 0);
                        ops::all_gather(w, TensorView(in, c.dtype, {count}), TensorView(outb, c.dtype, {total}), s,
                                        {.algo = static_cast<AllGatherAlgo>(c.algo)});
                        launch_check_gather(s, outb, c.dtype, c.count, call_seed, n, err);
                        break;
                    }
                    case Op::kReduceScatter: {
                        uint8_t* out = c.inplace ? inb + static_cast<uint64_t>(me) * c.count * es : outb;
                        launch_fill_pattern(s, inb, c.dtype, c.count * static_cast<uint64_t>(n), call_seed, me, 0);
                        if (!c.inplace) WEFT_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, c.count * es, s));
                        ops::reduce_scatter(w, TensorView(inb, c.dtype, {total}), TensorView(out, c.dtype, {count}), s,
                                            {.algo = static_cast<ReduceScatterAlgo>(c.algo)});
                        launch_check_sum(s, out, c.dtype, c.count, call_seed, n, static_cast<uint64_t>(me) * c.count,
                                         err);
                        break;
                    }
                }
            }
            w.sync_and_check(s);
            std::vector<unsigned long long> h(plan.size());
            WEFT_CUDA_CHECK(
                cudaMemcpyAsync(h.data(), errors, h.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost, s));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
            int reported = 0;
            for (size_t k = 0; k < plan.size(); ++k) {
                if (h[k] != 0 && reported++ < 10) {
                    ADD_FAILURE() << "rank " << me << " of " << n << ", " << describe(plan[k], static_cast<int>(k))
                                  << ": " << h[k] << " wrong elements";
                }
            }
            w.barrier();
            cudaFreeAsync(errors, s);
            b.release();
        },
        test_options(192ull << 20));
}

TEST(Collectives, StressBackToBackRandomCallsWithStragglers) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const uint64_t seed = test_seed();
    run_stress(8, 2500, seed);
    run_stress(5, 1000, seed + 1);
    run_stress(2, 1000, seed + 2);
}

// ------------------------------------------------------------------------------------------------
// CUDA graphs: the kernels keep their epochs in device memory, so a captured collective replays correctly any
// number of times, on inputs that change between replays.

void graph_case(int num_ranks, bool copy_engines) {
    const uint64_t seed = test_seed();
    run_ranks(
        num_ranks,
        [&](World& w) {
            constexpr uint64_t kCount = 70001;  // one-shot / two-shot / ll / rs / ag each get their own output
            const int n = w.num_ranks();
            const int me = w.rank();
            RankBuffers b(w, kCount * 4 * 8 * static_cast<uint64_t>(n));
            cudaStream_t s = b.stream();
            const DType t = DType::kBF16;
            const uint64_t es = 2;
            uint8_t* in = b.in_base(Place::kLocal) + kGuardBytes;          // local input
            uint8_t* sym_in = b.in_base(Place::kSymmetric) + kGuardBytes;  // symmetric input (direct paths)
            uint8_t* outs = b.out_base(Place::kSymmetric) + kGuardBytes;   // symmetric outputs, one region each
            const uint64_t region = kCount * es * static_cast<uint64_t>(n);
            const auto count = static_cast<int64_t>(kCount);
            const auto total = static_cast<int64_t>(kCount * static_cast<uint64_t>(n));
            cudaGraph_t graph = nullptr;
            WEFT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            if (!copy_engines) {
                int r = 0;
                for (AllReduceAlgo a : {AllReduceAlgo::kLowLatency, AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
                    ops::all_reduce(w, TensorView(in, t, {count}), TensorView(outs + region * r++, t, {count}), s,
                                    {.algo = a});
                }
                ops::all_reduce(w, TensorView(sym_in, t, {count}), TensorView(outs + region * r++, t, {count}), s,
                                {.algo = AllReduceAlgo::kTwoShot});
                const auto slice = static_cast<int64_t>(kCount / static_cast<uint64_t>(n));
                ops::reduce_scatter(w, TensorView(sym_in, t, {slice * n}), TensorView(outs + region * r++, t, {slice}),
                                    s, {.algo = ReduceScatterAlgo::kSmPull});
                ops::all_gather(w, TensorView(in, t, {count}), TensorView(outs + region * r++, t, {total}), s,
                                {.algo = AllGatherAlgo::kSmPush});
                ops::all_gather(w, TensorView(in, t, {count}), TensorView(outs + region * r++, t, {total}), s,
                                {.algo = AllGatherAlgo::kLowLatency});
                // LL reduce-scatter of a local input: every replay advances the epochs (flags and parities).
                ops::reduce_scatter(w, TensorView(in, t, {slice * n}), TensorView(outs + region * r++, t, {slice}), s,
                                    {.algo = ReduceScatterAlgo::kLowLatency});
            } else {
                ops::all_gather(w, TensorView(in, t, {count}), TensorView(outs, t, {total}), s,
                                {.algo = AllGatherAlgo::kCopyEnginePull});
                ops::all_gather(w, TensorView(sym_in, t, {count}), TensorView(outs + region, t, {total}), s,
                                {.algo = AllGatherAlgo::kCopyEnginePull});
                ops::all_gather(w, TensorView(in, t, {count}), TensorView(outs + 2 * region, t, {total}), s,
                                {.algo = AllGatherAlgo::kCopyEnginePush});
            }
            WEFT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
            cudaGraphExec_t exec = nullptr;
            WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            std::vector<std::string> failures;
            for (int replay = 0; replay < 5; ++replay) {
                const uint64_t rs = seed + 1000 * static_cast<uint64_t>(replay);
                WEFT_CUDA_CHECK(cudaMemsetAsync(outs, 0xFF, region * 8, s));
                launch_fill_pattern(s, in, t, kCount, rs, me, 0);
                launch_fill_pattern(s, sym_in, t, kCount, rs, me, 0);
                WEFT_CUDA_CHECK(cudaGraphLaunch(exec, s));
                w.sync_and_check(s);
                const std::vector<int32_t>& sums = reference_sums(rs, n, 0, kCount);
                const auto gather = [&](uint64_t k) {
                    return int_bits(pattern_value(rs, static_cast<int>(k / kCount), k % kCount), t);
                };
                const auto check = [&](int r, uint64_t elems, const auto& expected, const char* what) {
                    const std::vector<uint8_t> h = download(s, outs + region * r, elems * es);
                    const std::string err = compare(h, 0, elems, t, false, expected);
                    if (!err.empty()) failures.push_back("replay " + std::to_string(replay) + " " + what + ": " + err);
                };
                if (!copy_engines) {
                    const char* names[] = {"all_reduce ll", "all_reduce one_shot", "all_reduce two_shot",
                                           "all_reduce two_shot (symmetric input)"};
                    for (int r = 0; r < 4; ++r)
                        check(
                            r, kCount, [&](uint64_t i) { return int_bits(sums[i], t); }, names[r]);
                    const uint64_t slice = kCount / static_cast<uint64_t>(n);
                    const std::vector<int32_t>& rs_sums =
                        reference_sums(rs, n, static_cast<uint64_t>(me) * slice, slice);
                    check(
                        4, slice, [&](uint64_t i) { return int_bits(rs_sums[i], t); }, "reduce_scatter sm_pull");
                    check(5, kCount * n, gather, "all_gather sm_push");
                    check(6, kCount * n, gather, "all_gather ll");
                    check(
                        7, slice, [&](uint64_t i) { return int_bits(rs_sums[i], t); }, "reduce_scatter ll");
                } else {
                    check(0, kCount * n, gather, "all_gather ce_pull (staged)");
                    check(1, kCount * n, gather, "all_gather ce_pull (symmetric input)");
                    check(2, kCount * n, gather, "all_gather ce_push");
                }
            }
            for (const std::string& f : failures) ADD_FAILURE() << "rank " << me << " of " << n << ": " << f;
            WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
            WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
            b.release();
        },
        test_options(192ull << 20));
}

TEST(Collectives, GraphCaptureReplaysWithChangingInputs) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    graph_case(4, false);
    graph_case(3, false);
}

TEST(Collectives, GraphCaptureOfCopyEngineAllGather) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    graph_case(4, true);
}

// Ranks sharing one GPU: a graph of many back-to-back copy-engine all-gathers (what the benchmark captures: 20 calls)
// replays without deadlock and right, as do the same calls launched eagerly. With ranks on one GPU the copy-engine
// schedule is one chain on the caller's stream (all_gather.cpp, copy_engine_round): a branched capture let CUDA put
// a rank's copies behind another rank's next call in a shared queue (docs/runtime.md, "Hardware queues").
void shared_gpu_copy_engine_graph_case(int num_ranks) {
    const uint64_t seed = test_seed();
    WorldOptions options = test_options(128ull << 20);
    options.device = 0;  // every rank on GPU 0
    run_ranks(
        num_ranks,
        [&](World& w) {
            constexpr int kCalls = 20;
            constexpr uint64_t kShardCounts[] = {2, 3, 1000, 2048, 1};  // bf16 elements per shard, cycled
            constexpr uint64_t kMaxCount = 2048;
            const int n = w.num_ranks();
            const int me = w.rank();
            WEFT_CHECK(w.num_ranks_on_device() == n, "options.device = 0 should put all "
                                                         << n << " ranks on one GPU, found " << w.num_ranks_on_device()
                                                         << " on this rank's");
            const DType t = DType::kBF16;
            const uint64_t es = 2;
            const uint64_t region = kMaxCount * es * static_cast<uint64_t>(n);
            RankBuffers b(w, region * kCalls);
            cudaStream_t s = b.stream();
            uint8_t* in = b.in_base(Place::kLocal) + kGuardBytes;
            uint8_t* sym_in = b.in_base(Place::kSymmetric) + kGuardBytes;
            uint8_t* outs = b.out_base(Place::kSymmetric) + kGuardBytes;
            struct Call {
                AllGatherAlgo algo;
                bool sym_input;
                uint64_t count;
            };
            std::vector<Call> calls;
            for (int k = 0; k < kCalls; ++k) {
                const uint64_t count = kShardCounts[static_cast<size_t>(k) % std::size(kShardCounts)];
                switch (k % 3) {
                    case 0:
                        calls.push_back({AllGatherAlgo::kCopyEnginePull, true, count});  // peers read the input
                        break;
                    case 1:
                        calls.push_back({AllGatherAlgo::kCopyEnginePush, false, count});
                        break;
                    default:
                        calls.push_back({AllGatherAlgo::kCopyEnginePull, false, count});  // staged
                        break;
                }
            }
            const auto issue = [&] {
                for (int k = 0; k < kCalls; ++k) {
                    const Call& c = calls[static_cast<size_t>(k)];
                    const auto count = static_cast<int64_t>(c.count);
                    ops::all_gather(w, TensorView(c.sym_input ? sym_in : in, t, {count}),
                                    TensorView(outs + region * static_cast<uint64_t>(k), t, {count * n}), s,
                                    {.algo = c.algo});
                }
            };
            std::vector<std::string> failures;
            const auto run_and_check = [&](const char* how, uint64_t rs, const std::function<void()>& launch) {
                WEFT_CUDA_CHECK(cudaMemsetAsync(outs, 0xFF, region * kCalls, s));
                launch_fill_pattern(s, in, t, kMaxCount, rs, me, 0);
                launch_fill_pattern(s, sym_in, t, kMaxCount, rs, me, 0);
                launch();
                w.sync_and_check(s);
                for (int k = 0; k < kCalls; ++k) {
                    const Call& c = calls[static_cast<size_t>(k)];
                    const std::vector<uint8_t> h =
                        download(s, outs + region * static_cast<uint64_t>(k), c.count * es * static_cast<uint64_t>(n));
                    const std::string err = compare(h, 0, c.count * n, t, false, [&](uint64_t i) {
                        return int_bits(pattern_value(rs, static_cast<int>(i / c.count), i % c.count), t);
                    });
                    if (!err.empty()) {
                        failures.push_back(std::string(how) + ", call " + std::to_string(k) + " " +
                                           ops::algo_name(c.algo) + (c.sym_input ? " (symmetric input)" : "") +
                                           " count " + std::to_string(c.count) + ": " + err);
                    }
                }
            };
            run_and_check("eager", seed, issue);
            cudaGraph_t graph = nullptr;
            WEFT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            issue();
            WEFT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
            cudaGraphExec_t exec = nullptr;
            WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            for (int replay = 0; replay < 5; ++replay) {
                const std::string how = "graph replay " + std::to_string(replay);
                run_and_check(how.c_str(), seed + 77 * static_cast<uint64_t>(replay + 1),
                              [&] { WEFT_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
            }
            for (size_t i = 0; i < failures.size() && i < 20; ++i) {
                ADD_FAILURE() << "rank " << me << " of " << n << " (sharing GPU 0): " << failures[i];
            }
            WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
            WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
            b.release();
        },
        options);
}

TEST(Collectives, GraphOfManyCopyEngineAllGathersWithRanksSharingAGpu) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    shared_gpu_copy_engine_graph_case(2);
    shared_gpu_copy_engine_graph_case(3);
}

}  // namespace
}  // namespace weft::test
