// SPDX-License-Identifier: MIT
// The collectives' pure host logic: algorithm names, automatic selection, grids, argument checks, descriptors.
#include <algorithm>
#include <sstream>

#include "weft/common/math.hpp"
#include "weft/detail/collectives.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops {

namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * 1024;

template <class Algo, size_t N>
std::optional<Algo> parse_name(std::string_view name, const Algo (&all)[N]) {
    for (Algo a : all) {
        if (name == algo_name(a)) return a;
    }
    return std::nullopt;
}

template <class Algo, size_t N>
std::string choices(const Algo (&all)[N]) {
    std::string s;
    for (Algo a : all) {
        s += s.empty() ? "" : ", ";
        s += algo_name(a);
    }
    return s;
}

constexpr AllReduceAlgo kAllReduceAlgos[] = {AllReduceAlgo::kAuto, AllReduceAlgo::kLowLatency, AllReduceAlgo::kOneShot,
                                             AllReduceAlgo::kTwoShot};
constexpr AllGatherAlgo kAllGatherAlgos[] = {AllGatherAlgo::kAuto, AllGatherAlgo::kLowLatency, AllGatherAlgo::kSmPush,
                                             AllGatherAlgo::kCopyEnginePull, AllGatherAlgo::kCopyEnginePush};
constexpr ReduceScatterAlgo kReduceScatterAlgos[] = {ReduceScatterAlgo::kAuto, ReduceScatterAlgo::kSmPull,
                                                     ReduceScatterAlgo::kLowLatency};

int clamp_grid(uint64_t wanted, int cap, const CollectiveTopology& topo) {
    const uint64_t limit =
        static_cast<uint64_t>(std::max(1, std::min({cap, topo.grid_budget, static_cast<int>(kMaxCollectiveBlocks)})));
    return static_cast<int>(std::clamp<uint64_t>(wanted, 1, limit));
}

// The env value decides unless unset or "auto"; an unknown name is an error listing the choices.
template <class Algo, size_t N>
std::optional<Algo> from_env(const std::optional<std::string>& env_value, const char* env_name, const Algo (&all)[N]) {
    if (!env_value || env_value->empty() || *env_value == "auto") return std::nullopt;
    const std::optional<Algo> a = parse_name(*env_value, all);
    WEFT_CHECK(a.has_value(),
               env_name << "='" << *env_value << "' is not an algorithm; expected one of: " << choices(all));
    return a;
}

}  // namespace

const char* algo_name(AllReduceAlgo algo) {
    switch (algo) {
        case AllReduceAlgo::kAuto:
            return "auto";
        case AllReduceAlgo::kLowLatency:
            return "ll";
        case AllReduceAlgo::kOneShot:
            return "one_shot";
        case AllReduceAlgo::kTwoShot:
            return "two_shot";
    }
    return "?";
}

const char* algo_name(AllGatherAlgo algo) {
    switch (algo) {
        case AllGatherAlgo::kAuto:
            return "auto";
        case AllGatherAlgo::kLowLatency:
            return "ll";
        case AllGatherAlgo::kSmPush:
            return "sm_push";
        case AllGatherAlgo::kCopyEnginePull:
            return "ce_pull";
        case AllGatherAlgo::kCopyEnginePush:
            return "ce_push";
    }
    return "?";
}

const char* algo_name(ReduceScatterAlgo algo) {
    switch (algo) {
        case ReduceScatterAlgo::kAuto:
            return "auto";
        case ReduceScatterAlgo::kSmPull:
            return "sm_pull";
        case ReduceScatterAlgo::kLowLatency:
            return "ll";
    }
    return "?";
}

std::optional<AllReduceAlgo> parse_all_reduce_algo(std::string_view name) { return parse_name(name, kAllReduceAlgos); }
std::optional<AllGatherAlgo> parse_all_gather_algo(std::string_view name) { return parse_name(name, kAllGatherAlgos); }
std::optional<ReduceScatterAlgo> parse_reduce_scatter_algo(std::string_view name) {
    return parse_name(name, kReduceScatterAlgos);
}

bool select_hierarchical(const char* op, int num_nodes, std::string_view forced) {
    if (num_nodes <= 1) return false;
    const std::string_view o(op);
    const bool known = o == "all_reduce"   ? parse_name(forced, kAllReduceAlgos).has_value()
                       : o == "all_gather" ? parse_name(forced, kAllGatherAlgos).has_value()
                                           : parse_name(forced, kReduceScatterAlgos).has_value();
    WEFT_CHECK(forced.empty() || known, op << ": '" << forced << "' is not an algorithm; expected one of: "
                                           << (o == "all_reduce"   ? choices(kAllReduceAlgos)
                                               : o == "all_gather" ? choices(kAllGatherAlgos)
                                                                   : choices(kReduceScatterAlgos)));
    WEFT_CHECK(forced.empty() || forced == "auto",
               op << ": the algorithm '" << forced << "' needs every member load/store reachable, but the team spans "
                  << num_nodes << " nodes (docs/multinode.md): leave the algorithm on auto (the hierarchical one)");
    return true;
}

uint64_t low_latency_threshold_bytes(const CollectiveTopology& topo) {
    const uint64_t peers = static_cast<uint64_t>(std::max(1, topo.num_ranks - 1));
    uint64_t t = 512 * kKiB / peers;
    uint64_t pow2 = 1;
    while (pow2 * 2 <= t) pow2 *= 2;  // round down to a power of two: thresholds stay readable
    t = std::clamp<uint64_t>(pow2, 16 * kKiB, 256 * kKiB);
    return std::min(t, topo.low_latency_capacity_bytes);
}

AllReduceAlgo select_all_reduce_algo(uint64_t bytes, const CollectiveTopology& topo) {
    if (bytes <= low_latency_threshold_bytes(topo)) return AllReduceAlgo::kLowLatency;
    // One-shot reads (n - 1) x bytes, two-shot 2 (n - 1) / n x bytes plus a barrier. Even with 2 ranks (the same
    // bytes read) two-shot wins from a few MiB: its reads spread over twice the blocks and its writes are
    // pushes (the measurements: kernels/all_reduce/README.md, "Why the thresholds").
    const uint64_t one_shot_max = topo.num_ranks <= 4 ? 1 * kMiB : 256 * kKiB;
    return bytes <= one_shot_max ? AllReduceAlgo::kOneShot : AllReduceAlgo::kTwoShot;
}

AllGatherAlgo select_all_gather_algo(uint64_t shard_bytes, const CollectiveTopology& topo, bool output_symmetric) {
    if (shard_bytes <= low_latency_threshold_bytes(topo)) return AllGatherAlgo::kLowLatency;
    if (!output_symmetric) return AllGatherAlgo::kCopyEnginePull;
    // Copy engines reach NVLink's rate without SMs but cost a few microseconds of set-up per copy; between ranks
    // sharing a GPU every byte crosses the same HBM either way and SM copies start sooner.
    const uint64_t total = shard_bytes * static_cast<uint64_t>(topo.num_ranks);
    // The crossover was measured between 16 and 64 MiB gathered (kernels/all_gather/README.md, "Why the thresholds").
    if (topo.max_ranks_per_gpu > 1 || total < 64 * kMiB) return AllGatherAlgo::kSmPush;
    return AllGatherAlgo::kCopyEnginePush;
}

ReduceScatterAlgo select_reduce_scatter_algo(uint64_t output_bytes, const CollectiveTopology& topo) {
    // LL sends each rank (n - 1) x output_bytes of payload (twice that in lines) and waits for nothing but the
    // data: per output byte the traffic of an LL all-reduce of output_bytes, so the same threshold. SM pull pays an
    // entry-barrier round trip before its first read, which makes it slower than LL (and NCCL) for small outputs
    // (the measurements: kernels/reduce_scatter/README.md, "Why LL for small outputs").
    if (output_bytes <= low_latency_threshold_bytes(topo)) return ReduceScatterAlgo::kLowLatency;
    return ReduceScatterAlgo::kSmPull;
}

AllReduceAlgo resolve_all_reduce_algo(AllReduceAlgo requested, const std::optional<std::string>& env_value,
                                      uint64_t bytes, const CollectiveTopology& topo, const char* env_name) {
    detail::check_algo_option(requested);
    if (requested != AllReduceAlgo::kAuto) return requested;
    if (auto a = from_env(env_value, env_name, kAllReduceAlgos)) return *a;
    return select_all_reduce_algo(bytes, topo);
}

AllGatherAlgo resolve_all_gather_algo(AllGatherAlgo requested, const std::optional<std::string>& env_value,
                                      uint64_t shard_bytes, const CollectiveTopology& topo, bool output_symmetric,
                                      const char* env_name) {
    detail::check_algo_option(requested);
    if (requested != AllGatherAlgo::kAuto) return requested;
    if (auto a = from_env(env_value, env_name, kAllGatherAlgos)) return *a;
    return select_all_gather_algo(shard_bytes, topo, output_symmetric);
}

ReduceScatterAlgo resolve_reduce_scatter_algo(ReduceScatterAlgo requested, const std::optional<std::string>& env_value,
                                              uint64_t output_bytes, const CollectiveTopology& topo,
                                              const char* env_name) {
    detail::check_algo_option(requested);
    if (requested != ReduceScatterAlgo::kAuto) return requested;
    if (auto a = from_env(env_value, env_name, kReduceScatterAlgos)) return *a;
    return select_reduce_scatter_algo(output_bytes, topo);
}

int all_reduce_grid(AllReduceAlgo algo, uint64_t bytes, const CollectiveTopology& topo) {
    const uint64_t n = static_cast<uint64_t>(std::max(1, topo.num_ranks));
    switch (algo) {
        case AllReduceAlgo::kLowLatency:
            return clamp_grid(ceil_div(bytes, 2 * kKiB), 32, topo);  // a line a thread
        case AllReduceAlgo::kOneShot:
            return clamp_grid(ceil_div(bytes, 8 * kKiB), 32, topo);
        case AllReduceAlgo::kTwoShot:
            return clamp_grid(ceil_div(bytes / n, 16 * kKiB), 64, topo);
        case AllReduceAlgo::kAuto:
            break;
    }
    WEFT_FAIL("all_reduce_grid: resolve the algorithm first (got auto)");
}

int all_gather_grid(AllGatherAlgo algo, uint64_t shard_bytes, const CollectiveTopology& topo) {
    switch (algo) {
        case AllGatherAlgo::kLowLatency:
            return clamp_grid(ceil_div(shard_bytes, 2 * kKiB), 32, topo);
        case AllGatherAlgo::kSmPush:
            return clamp_grid(ceil_div(shard_bytes, 16 * kKiB), 64, topo);
        case AllGatherAlgo::kCopyEnginePull:
        case AllGatherAlgo::kCopyEnginePush:
            return 1;  // the entry barrier kernel; copy engines move the data
        case AllGatherAlgo::kAuto:
            break;
    }
    WEFT_FAIL("all_gather_grid: resolve the algorithm first (got auto)");
}

int reduce_scatter_grid(ReduceScatterAlgo algo, uint64_t output_bytes, const CollectiveTopology& topo) {
    switch (algo) {
        case ReduceScatterAlgo::kSmPull:
            return clamp_grid(ceil_div(output_bytes, 16 * kKiB), 64, topo);
        case ReduceScatterAlgo::kLowLatency:
            return clamp_grid(ceil_div(output_bytes, 2 * kKiB), 32, topo);  // a line of output a thread
        case ReduceScatterAlgo::kAuto:
            break;
    }
    WEFT_FAIL("reduce_scatter_grid: resolve the algorithm first (got auto)");
}

namespace detail {

void check_collective_view(const TensorView& v, const char* what, const char* op) {
    WEFT_CHECK(v.ndim >= 0 && v.ndim <= TensorView::kMaxDims,
               op << ": " << what << " must have 0 to " << TensorView::kMaxDims << " dimensions, got " << v.ndim);
    for (int i = 0; i < v.ndim; ++i) {
        WEFT_CHECK(v.dim(i) >= 0, op << ": " << what << " has a negative extent: " << v.describe());
    }
    WEFT_CHECK(dtype_bytes(v.dtype) > 0,
               op << ": " << what << " has an unknown dtype (DType value " << static_cast<int>(v.dtype) << ")");
}

namespace {

template <class Algo, size_t N>
void check_algo_in(Algo algo, const Algo (&all)[N], const char* op) {
    bool known = false;
    for (Algo a : all) known = known || a == algo;
    WEFT_CHECK(known,
               op << ": options.algo must be one of " << choices(all) << ", got the value " << static_cast<int>(algo));
}

}  // namespace

void check_algo_option(AllReduceAlgo algo) { check_algo_in(algo, kAllReduceAlgos, "all_reduce"); }
void check_algo_option(AllGatherAlgo algo) { check_algo_in(algo, kAllGatherAlgos, "all_gather"); }
void check_algo_option(ReduceScatterAlgo algo) { check_algo_in(algo, kReduceScatterAlgos, "reduce_scatter"); }

namespace {

bool is_reducible(DType t) { return t == DType::kBF16 || t == DType::kF16 || t == DType::kF32; }

void check_view(const TensorView& v, const char* what, const char* op) {
    check_collective_view(v, what, op);
    WEFT_CHECK(v.numel() == 0 || v.data != nullptr,
               op << ": " << what << " is null but holds " << v.numel() << " elements (" << v.describe() << ")");
    WEFT_CHECK(v.is_contiguous(), op << ": " << what << " must be contiguous, got " << v.describe());
    WEFT_CHECK(reinterpret_cast<uintptr_t>(v.data) % static_cast<uintptr_t>(dtype_bytes(v.dtype)) == 0,
               op << ": " << what << " must be aligned to its element size (" << dtype_bytes(v.dtype) << " bytes), got "
                  << v.data);
}

bool overlap(const void* a, uint64_t a_bytes, const void* b, uint64_t b_bytes) {
    const auto x = reinterpret_cast<uintptr_t>(a);
    const auto y = reinterpret_cast<uintptr_t>(b);
    return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

}  // namespace

void check_all_reduce_args(const TensorView& input, const TensorView& output) {
    check_view(input, "input", "all_reduce");
    check_view(output, "output", "all_reduce");
    WEFT_CHECK(input.dtype == output.dtype, "all_reduce: input and output must have the same dtype, got "
                                                << dtype_name(input.dtype) << " and " << dtype_name(output.dtype));
    WEFT_CHECK(is_reducible(input.dtype),
               "all_reduce: dtype must be bf16, f16 or f32, got " << dtype_name(input.dtype));
    WEFT_CHECK(input.numel() == output.numel(), "all_reduce: output must have as many elements as input ("
                                                    << input.numel() << "), got " << output.numel());
    const auto bytes = static_cast<uint64_t>(input.size_bytes());
    WEFT_CHECK(input.data == output.data || !overlap(input.data, bytes, output.data, bytes),
               "all_reduce: output must be the input (in place) or not overlap it; they partly overlap ("
                   << input.data << " and " << output.data << ", " << bytes << " bytes)");
}

void check_all_gather_args(const TensorView& input, const TensorView& output, int num_ranks, int rank) {
    check_view(input, "input", "all_gather");
    check_view(output, "output", "all_gather");
    WEFT_CHECK(input.dtype == output.dtype, "all_gather: input and output must have the same dtype, got "
                                                << dtype_name(input.dtype) << " and " << dtype_name(output.dtype));
    WEFT_CHECK(output.numel() == input.numel() * num_ranks,
               "all_gather: output must hold num_ranks (" << num_ranks << ") x input elements ("
                                                          << input.numel() * num_ranks << "), got " << output.numel());
    const auto shard = static_cast<uint64_t>(input.size_bytes());
    const auto* slot = static_cast<const uint8_t*>(output.data) + static_cast<uint64_t>(rank) * shard;
    WEFT_CHECK(input.data == slot || !overlap(input.data, shard, output.data, shard * static_cast<uint64_t>(num_ranks)),
               "all_gather: input must be this rank's slot of output (in place: output + rank x "
                   << input.numel() << " elements = " << static_cast<const void*>(slot)
                   << ") or not overlap output; got input " << input.data << ", output " << output.data);
}

void check_reduce_scatter_args(const TensorView& input, const TensorView& output, int num_ranks, int rank) {
    check_view(input, "input", "reduce_scatter");
    check_view(output, "output", "reduce_scatter");
    WEFT_CHECK(input.dtype == output.dtype, "reduce_scatter: input and output must have the same dtype, got "
                                                << dtype_name(input.dtype) << " and " << dtype_name(output.dtype));
    WEFT_CHECK(is_reducible(input.dtype),
               "reduce_scatter: dtype must be bf16, f16 or f32, got " << dtype_name(input.dtype));
    WEFT_CHECK(input.numel() == output.numel() * num_ranks,
               "reduce_scatter: input must hold num_ranks ("
                   << num_ranks << ") x output elements (" << output.numel() * num_ranks << "), got " << input.numel());
    const auto slice = static_cast<uint64_t>(output.size_bytes());
    const auto* mine = static_cast<const uint8_t*>(input.data) + static_cast<uint64_t>(rank) * slice;
    WEFT_CHECK(
        output.data == mine || !overlap(output.data, slice, input.data, slice * static_cast<uint64_t>(num_ranks)),
        "reduce_scatter: output must be this rank's slice of input (in place: input + rank x "
            << output.numel() << " elements = " << static_cast<const void*>(mine)
            << ") or not overlap input; got output " << output.data << ", input " << input.data);
}

void check_all_gather_output(AllGatherAlgo algo, bool output_symmetric) {
    WEFT_CHECK(output_symmetric || (algo != AllGatherAlgo::kSmPush && algo != AllGatherAlgo::kCopyEnginePush),
               "all_gather: algorithm " << algo_name(algo)
                                        << " writes into the peers' outputs, so output must be on the symmetric heap "
                                           "(SymmetricHeap::alloc); it is not (use ll, ce_pull or auto)");
}

namespace {

uint64_t mix_words(std::initializer_list<uint64_t> words) {
    uint64_t h = 0;
    for (uint64_t w : words) h = call_descriptor_mix(h, w);
    return h;
}

}  // namespace

uint64_t call_descriptor(CollectiveOp op, uint32_t algo, DType dtype, uint64_t count,
                         std::initializer_list<uint64_t> words) {
    return make_call_descriptor(op, algo, true, dtype, count, mix_words(words));
}

uint64_t call_descriptor_bytes(CollectiveOp op, uint32_t algo, uint64_t bytes, std::initializer_list<uint64_t> words) {
    return make_call_descriptor(op, algo, false, DType::kU8, bytes, mix_words(words));
}

uint64_t round_units(uint64_t capacity_bytes, uint64_t bytes_per_unit, uint64_t granule_units) {
    WEFT_CHECK(bytes_per_unit > 0 && granule_units > 0, "round_units: bytes_per_unit and granule_units must be > 0");
    uint64_t units = capacity_bytes / bytes_per_unit;
    units -= units % granule_units;
    WEFT_CHECK(units > 0, "a collective buffer of " << capacity_bytes << " bytes cannot hold one granule of "
                                                    << granule_units << " x " << bytes_per_unit
                                                    << " bytes (raise WEFT_COLLECTIVE_STAGING_BYTES)");
    return units;
}

bool copy_engine_copies_with_kernel(bool same_process, int ranks_on_device, int team_ranks) {
    return same_process && team_ranks > 1 && ranks_on_device > 1;
}

std::vector<PeerPullItem> copy_engine_kernel_items(bool pull, int num_ranks, int rank, const uint8_t* in, uint8_t* out,
                                                   uint64_t shard, uint64_t begin, uint64_t len,
                                                   std::span<const uint8_t* const> from, std::span<uint8_t* const> to,
                                                   std::span<uint64_t* const> flag_on) {
    const auto n = static_cast<size_t>(num_ranks);
    WEFT_CHECK(num_ranks >= 1 && rank >= 0 && rank < num_ranks,
               "copy_engine_kernel_items: rank " << rank << " outside a team of " << num_ranks);
    WEFT_CHECK(flag_on.size() == n && (pull ? from.size() : to.size()) == n,
               "copy_engine_kernel_items: one " << (pull ? "source" : "destination") << " and one flag per rank ("
                                                << num_ranks << "), got " << (pull ? from.size() : to.size()) << " and "
                                                << flag_on.size());
    std::vector<PeerPullItem> items;
    for (int k = 1; k < num_ranks; ++k) {
        const int q = (rank + k) % num_ranks;
        const auto qi = static_cast<size_t>(q);
        PeerPullItem it{};
        it.dst = pull ? static_cast<void*>(out + static_cast<uint64_t>(q) * shard + begin) : static_cast<void*>(to[qi]);
        it.src = pull ? static_cast<const void*>(from[qi]) : static_cast<const void*>(in + begin);
        it.signal = flag_on[qi];
        it.bytes = len;
        it.peer = q;
        it.chunk = pull ? q : rank;  // the output slot written, as the copy-engine path's traced copies name it
        items.push_back(it);
    }
    uint8_t* own = out + static_cast<uint64_t>(rank) * shard + begin;
    if (own != in + begin) {
        PeerPullItem it{};
        it.dst = own;
        it.src = in + begin;
        it.bytes = len;
        it.peer = rank;
        it.chunk = rank;
        items.push_back(it);
    }
    return items;
}

}  // namespace detail

}  // namespace weft::ops
