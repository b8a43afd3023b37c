// SPDX-License-Identifier: MIT
// weft::ops::ep host maths: config validation, memory footprint, sizing estimates, default SM counts, kernel specs,
// status text.
#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <sstream>

#include "ep_buffer.hpp"
#include "weft/jit/aot.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops::ep {

using detail::kThreads;

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxDynamicSmemBytes = 227 * 1024;  // sm_90 opt-in limit per block

std::string mib(uint64_t bytes) {
    std::ostringstream os;
    os.setf(std::ios::fixed);
    os.precision(1);
    os << static_cast<double>(bytes) / (1024.0 * 1024.0) << " MiB";
    return os.str();
}

}  // namespace

Geometry resolve_geometry(const Config& c, int num_ranks, int rank) {
    WEFT_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks,
               "ep: the number of ranks must be in 1.." << kMaxRanks << ", got " << num_ranks);
    WEFT_CHECK(rank >= 0 && rank < num_ranks, "ep: rank must be in 0.." << num_ranks - 1 << ", got " << rank);
    WEFT_CHECK(c.num_experts >= 1 && c.num_experts <= kMaxExperts,
               "ep: Config::num_experts must be in 1.." << kMaxExperts << ", got " << c.num_experts);
    WEFT_CHECK(c.num_experts % num_ranks == 0, "ep: Config::num_experts ("
                                                   << c.num_experts << ") must be a multiple of the number of ranks ("
                                                   << num_ranks << ") so that experts spread evenly");
    WEFT_CHECK(c.hidden >= 8 && c.hidden % 8 == 0,
               "ep: Config::hidden must be a positive multiple of 8 (16-byte bf16 rows), got " << c.hidden);
    WEFT_CHECK(c.hidden <= (1 << 20), "ep: Config::hidden must be at most 2^20, got " << c.hidden);
    WEFT_CHECK(c.topk >= 1 && c.topk <= kMaxTopk && c.topk <= c.num_experts,
               "ep: Config::topk must be in 1..min(" << kMaxTopk << ", num_experts = " << c.num_experts << "), got "
                                                     << c.topk);
    WEFT_CHECK(c.max_tokens_per_rank >= 1 && c.max_tokens_per_rank <= (1 << 24),
               "ep: Config::max_tokens_per_rank must be in 1..2^24, got " << c.max_tokens_per_rank);
    WEFT_CHECK(c.normal || c.low_latency, "ep: Config enables neither the normal nor the low-latency mode");
    WEFT_CHECK(!c.low_latency || c.max_tokens_per_rank <= kMaxLowLatencyTokens,
               "ep: low-latency mode supports at most "
                   << kMaxLowLatencyTokens << " tokens per rank (Config::max_tokens_per_rank = "
                   << c.max_tokens_per_rank << "); use the normal mode, or set low_latency = false");
    WEFT_CHECK(c.expert_alignment >= 1 && c.expert_alignment <= kMaxExpertAlignment,
               "ep: Config::expert_alignment must be in 1.." << kMaxExpertAlignment << ", got " << c.expert_alignment);
    WEFT_CHECK(c.max_recv_tokens >= 0,
               "ep: Config::max_recv_tokens must be >= 0 (0 = worst case), got " << c.max_recv_tokens);
    WEFT_CHECK(c.max_recv_rows >= 0,
               "ep: Config::max_recv_rows must be >= 0 (0 = worst case), got " << c.max_recv_rows);

    Geometry g{};
    g.num_ranks = num_ranks;
    g.rank = rank;
    g.num_experts = c.num_experts;
    g.hidden = c.hidden;
    g.topk = c.topk;
    g.max_tokens = c.max_tokens_per_rank;
    g.expert_alignment = c.expert_alignment;
    g.modes = (c.normal ? weft::ep::kNormalMode : 0) | (c.low_latency ? weft::ep::kLowLatencyMode : 0);
    const int64_t local = g.local_experts();
    const int64_t worst_tokens = int64_t{num_ranks} * c.max_tokens_per_rank;
    const int64_t worst_rows = worst_tokens * std::min<int64_t>(c.topk, local) + local * (c.expert_alignment - 1);
    g.max_recv_tokens = c.max_recv_tokens > 0 ? c.max_recv_tokens : worst_tokens;
    g.max_recv_rows = c.max_recv_rows > 0 ? c.max_recv_rows : worst_rows;
    WEFT_CHECK(g.max_recv_tokens <= kInt32Max, "ep: max_recv_tokens ("
                                                   << g.max_recv_tokens << ", worst case " << worst_tokens
                                                   << ") must fit in int32; set Config::max_recv_tokens lower");
    // recv_x is the grouped GEMM's A: its rows within the GEMMs' extent.
    WEFT_CHECK(g.max_recv_rows <= kGemmMaxExtent, "ep: max_recv_rows ("
                                                      << g.max_recv_rows << ", worst case " << worst_rows
                                                      << ") must be at most 2^31 - 2^24 (recv_x is a grouped GEMM's "
                                                         "A); set Config::max_recv_rows lower");
    WEFT_CHECK(g.max_send_rows() <= kInt32Max, "ep: max_tokens_per_rank * min(topk, ranks) must fit in int32");

    const int64_t layout_smem = weft::ep::LayoutSmem::make(g, kThreads).total;
    const int64_t normal_smem = weft::ep::NormalSmem::make(g, kThreads).total;
    WEFT_CHECK(layout_smem <= kMaxDynamicSmemBytes && normal_smem <= kMaxDynamicSmemBytes,
               "ep: " << c.num_experts << " experts over " << num_ranks << " ranks need "
                      << std::max(layout_smem, normal_smem) << " bytes of shared memory per block, more than "
                      << kMaxDynamicSmemBytes);
    if (c.low_latency) {
        const int64_t ll_smem = weft::ep::LowLatencySmem::make(g, kThreads).total;
        WEFT_CHECK(ll_smem <= kMaxDynamicSmemBytes, "ep: the low-latency kernels need "
                                                        << ll_smem << " bytes of shared memory per block for "
                                                        << c.max_tokens_per_rank << " tokens x top-" << c.topk
                                                        << " and " << c.num_experts << " experts, more than "
                                                        << kMaxDynamicSmemBytes << "; lower max_tokens_per_rank");
    }
    return g;
}

namespace detail {

Config one_rank_config(const Geometry& g) {
    const weft::ep::InternodeLayout net = weft::ep::InternodeLayout::make(g);
    WEFT_CHECK(net.records() <= (int64_t{1} << 24),
               "ep: across nodes a rank receives num_ranks x max_tokens_per_rank = "
                   << net.records() << " records per dispatch, more than 2^24; lower max_tokens_per_rank");
    Config one;
    one.num_experts = g.local_experts();
    one.hidden = g.hidden;
    one.topk = net.local_topk;
    one.max_tokens_per_rank = static_cast<int>(net.records());
    one.normal = true;
    one.low_latency = false;
    one.max_recv_tokens = g.max_recv_tokens;
    one.max_recv_rows = g.max_recv_rows;
    one.expert_alignment = g.expert_alignment;
    return one;
}

}  // namespace detail

uint64_t Footprint::heap_bytes(int normal_handles) const {
    constexpr uint64_t kSlack = 2ull << 20;  // VMM granularity of the heap
    const uint64_t bytes = buffer_symmetric_bytes + node_collectives_symmetric_bytes +
                           static_cast<uint64_t>(normal_handles) * normal_handle_symmetric_bytes;
    return static_cast<uint64_t>(round_up(static_cast<int64_t>(bytes), weft::ep::kArrayAlign)) + kSlack;
}

uint64_t Footprint::total_bytes(int normal_handles, int low_latency_handles) const {
    return buffer_symmetric_bytes + buffer_device_bytes + node_collectives_symmetric_bytes +
           static_cast<uint64_t>(normal_handles) * (normal_handle_symmetric_bytes + normal_handle_device_bytes) +
           static_cast<uint64_t>(low_latency_handles) * low_latency_handle_device_bytes;
}

std::string Footprint::describe() const {
    std::ostringstream os;
    os << "buffer: " << mib(buffer_symmetric_bytes) << " symmetric + " << mib(buffer_device_bytes)
       << " device; per normal handle: " << mib(normal_handle_symmetric_bytes) << " symmetric + "
       << mib(normal_handle_device_bytes) << " device; per low-latency handle: " << mib(low_latency_handle_device_bytes)
       << " device";
    if (node_collectives_symmetric_bytes > 0) {
        os << "; node stage collectives: " << mib(node_collectives_symmetric_bytes) << " symmetric";
    }
    return os.str();
}

Footprint footprint(const Config& config, int num_ranks) {
    const Workspace ws = Workspace::make(resolve_geometry(config, num_ranks, 0));
    Footprint f;
    f.buffer_symmetric_bytes = static_cast<uint64_t>(ws.buffer_symmetric.bytes);
    f.buffer_device_bytes = static_cast<uint64_t>(ws.buffer_device.bytes);
    f.normal_handle_symmetric_bytes = static_cast<uint64_t>(ws.normal_handle_symmetric.bytes);
    f.normal_handle_device_bytes = static_cast<uint64_t>(ws.normal_handle_device.bytes);
    f.low_latency_handle_device_bytes = static_cast<uint64_t>(ws.low_latency_handle_device.bytes);
    return f;
}

Footprint footprint(const Config& config, int num_ranks, int num_nodes) {
    WEFT_CHECK(num_nodes >= 1, "ep::footprint: num_nodes must be >= 1 (the nodes the team spans), got " << num_nodes);
    if (num_nodes == 1) return footprint(config, num_ranks);
    WEFT_CHECK(num_ranks >= num_nodes && num_ranks % num_nodes == 0,
               "ep::footprint: num_ranks ("
                   << num_ranks << ") must be a positive multiple of num_nodes (" << num_nodes
                   << "): across nodes every node holds the same number of the team's members");
    const Geometry g = resolve_geometry(config, num_ranks, 0);
    const Workspace ws = Workspace::make(g);
    const int per_node = num_ranks / num_nodes;
    // What Buffer::Impl::init_across_nodes and its handles allocate (src/ops/ep_internode.cpp), from the same layouts.
    Footprint f;
    f.buffer_device_bytes =
        static_cast<uint64_t>(ws.buffer_device.bytes + weft::ep::node_table_bytes(static_cast<int32_t>(num_ranks)));
    // Every exchange goes through ops::all_to_all's node stage (the two-hop dispatch's node all_to_all too): the node
    // team's collective workspace.
    f.node_collectives_symmetric_bytes = collective_workspace_heap_bytes(per_node);
    if (config.normal) {
        // The one-rank Buffer and, per handle, its handle; the team-wide layout arrays and the exchange buffers of the
        // two-hop dispatch (the default; WEFT_EP_ACROSS_NODES=all_to_all allocates less).
        const Footprint one = footprint(detail::one_rank_config(g), 1);
        const weft::ep::NormalExchangeLayout x = weft::ep::NormalExchangeLayout::make(
            weft::ep::InternodeLayout::make(g), weft::ep::NodeRecordLayout::make(g, num_nodes, per_node), true);
        f.buffer_symmetric_bytes = one.buffer_symmetric_bytes;
        f.buffer_device_bytes += one.buffer_device_bytes;
        f.normal_handle_symmetric_bytes = one.normal_handle_symmetric_bytes;
        f.normal_handle_device_bytes =
            static_cast<uint64_t>(ws.normal_handle_device.bytes + x.bytes) + one.normal_handle_device_bytes;
    }
    if (config.low_latency) {
        const weft::ep::LowLatencyExchangeLayout x =
            weft::ep::LowLatencyExchangeLayout::make(weft::ep::LowLatencyRecordLayout::make(g));
        f.low_latency_handle_device_bytes = static_cast<uint64_t>(ws.low_latency_handle_device.bytes + x.bytes);
    }
    return f;
}

int64_t expected_recv_tokens(const Config& config, int num_ranks) {
    const Geometry g = resolve_geometry(config, num_ranks, 0);
    // P(a token has none of its k distinct experts on a given rank) = C(E - L, k) / C(E, k).
    double none = 1.0;
    for (int i = 0; i < g.topk; ++i) {
        none *= static_cast<double>(g.num_experts - g.local_experts() - i) / static_cast<double>(g.num_experts - i);
        if (none <= 0.0) {
            none = 0.0;
            break;
        }
    }
    return static_cast<int64_t>(std::ceil(static_cast<double>(num_ranks) * g.max_tokens * (1.0 - none)));
}

int64_t expected_recv_rows(const Config& config, int num_ranks) {
    const Geometry g = resolve_geometry(config, num_ranks, 0);
    // Every token has k routes; uniform routing spreads W * T * k routes over W ranks.
    return int64_t{g.max_tokens} * g.topk + int64_t{g.local_experts()} * (g.expert_alignment - 1);
}

int default_normal_sms(int num_tokens, int sm_budget) {
    const int wanted = std::max(1, (num_tokens + 63) / 64);
    return std::max(1, std::min({wanted, 24, sm_budget}));
}

int default_low_latency_sms(int num_tokens, int topk, int sm_budget) {
    const int64_t routes = int64_t{num_tokens} * topk;
    const int wanted = static_cast<int>(std::max<int64_t>(1, (routes + 31) / 32));
    return std::max(1, std::min(wanted, sm_budget));
}

std::vector<jit::KernelSpec> kernel_specs() {
    const auto spec = [](const char* header, const std::string& instantiation, const std::string& description) {
        jit::KernelSpec s;
        s.header = header;
        s.instantiation = instantiation;
        s.description = description;
        return s;
    };
    const std::string t = std::to_string(kThreads);
    const auto ll = [&t](const char* kernel) {
        return std::string("weft::kernels::ep::") + kernel +
               "<weft::kernels::ep::InternodeLowLatencyConfig{.threads = " + t + ", .unroll = 2}>";
    };
    return {
        spec("ep/layout.cuh", "weft::kernels::ep::layout<weft::kernels::ep::LayoutConfig{.threads = " + t + "}>",
             "ep::layout"),
        spec("ep/normal.cuh",
             "weft::kernels::ep::normal_dispatch<weft::kernels::ep::NormalConfig{.threads = " + t + ", .unroll = 4}>",
             "ep::normal_dispatch"),
        spec("ep/normal.cuh",
             "weft::kernels::ep::normal_combine<weft::kernels::ep::NormalConfig{.threads = " + t + ", .unroll = 4}>",
             "ep::normal_combine"),
        spec("ep/low_latency.cuh",
             "weft::kernels::ep::low_latency_dispatch<weft::kernels::ep::LowLatencyConfig{.threads = " + t +
                 ", .unroll = 2}>",
             "ep::low_latency_dispatch"),
        spec("ep/low_latency.cuh",
             "weft::kernels::ep::low_latency_combine<weft::kernels::ep::LowLatencyConfig{.threads = " + t +
                 ", .unroll = 2}>",
             "ep::low_latency_combine"),
        spec("ep/internode.cuh",
             "weft::kernels::ep::internode_pack<weft::kernels::ep::InternodeConfig{.threads = " + t + ", .unroll = 4}>",
             "ep::internode_pack"),
        spec("ep/internode.cuh",
             "weft::kernels::ep::internode_sum<weft::kernels::ep::InternodeConfig{.threads = " + t + ", .unroll = 4}>",
             "ep::internode_sum"),
        spec("ep/internode.cuh",
             "weft::kernels::ep::internode_node_pack<weft::kernels::ep::InternodeConfig{.threads = " + t +
                 ", .unroll = 4}>",
             "ep::internode_node_pack"),
        spec("ep/internode.cuh",
             "weft::kernels::ep::internode_forward<weft::kernels::ep::InternodeConfig{.threads = " + t +
                 ", .unroll = 4}>",
             "ep::internode_forward"),
        spec("ep/internode_ll.cuh", ll("internode_ll_pack"), "ep::internode_ll_pack"),
        spec("ep/internode_ll.cuh", ll("internode_ll_layout"), "ep::internode_ll_layout"),
        spec("ep/internode_ll.cuh", ll("internode_ll_copy"), "ep::internode_ll_copy"),
        spec("ep/internode_ll.cuh", ll("internode_ll_combine_pack"), "ep::internode_ll_combine_pack"),
        spec("ep/internode_ll.cuh", ll("internode_ll_combine_sum"), "ep::internode_ll_combine_sum"),
    };
}

void register_ep_aot_specs() {
    static std::once_flag once;
    std::call_once(once, [] {
        for (jit::KernelSpec& s : kernel_specs()) jit::register_aot_spec(std::move(s));
    });
}

namespace {

// Two low-latency call signatures (weft::ep::ll_call_signature) in words.
std::string describe_ll_call_mismatch(uint32_t mine, uint32_t theirs, int32_t rank, int32_t peer) {
    std::ostringstream os;
    const auto dtype = [](uint32_t sig) { return weft::ep::ll_signature_fp8(sig) ? "fp8 (e4m3)" : "bf16"; };
    os << "rank " << rank << " called it with " << dtype(mine) << ", rank " << peer << " with " << dtype(theirs);
    if (weft::ep::ll_signature_digest(mine) != weft::ep::ll_signature_digest(theirs)) {
        os << ", and their Buffers' geometries differ (hidden, num_experts, topk, max_tokens_per_rank or ranks; digest "
           << std::hex << "0x" << weft::ep::ll_signature_digest(mine) << " against 0x"
           << weft::ep::ll_signature_digest(theirs) << std::dec << ")";
    }
    return os.str();
}

}  // namespace

namespace {

/// describe_status; `one_rank_skipped`: a receive overflow only this rank skipped (a team across nodes).
std::string describe_status_text(const Status& s, bool one_rank_skipped) {
    std::ostringstream os;
    os << "ep: rank " << s.rank << ": ";
    const char* kernel = "?";
    switch (static_cast<KernelId>(s.kernel)) {
        case KernelId::kLayout:
            kernel = "layout";
            break;
        case KernelId::kNormalDispatch:
            kernel = "normal dispatch";
            break;
        case KernelId::kNormalCombine:
            kernel = "normal combine";
            break;
        case KernelId::kLowLatencyDispatch:
            kernel = "low-latency dispatch";
            break;
        case KernelId::kLowLatencyCombine:
            kernel = "low-latency combine";
            break;
    }
    // A team across nodes: only the overflowing rank skips the call (docs/multinode.md, "EP across nodes").
    const char* skipped = one_rank_skipped
                              ? "; this rank received nothing (it skipped the call; the ranks within their limits "
                                "went ahead, and this rank's partials in their combine are zeros). "
                              : "; nothing was moved (every rank skipped the call; its combine returns zeros). ";
    switch (s.code) {
        case StatusCode::kOk:
            os << "no error";
            return os.str();
        case StatusCode::kRecvTokensOverflow:
            os << "receive capacity exceeded in " << kernel << " call " << s.call << ": rank " << s.culprit_rank
               << " would receive " << s.value << " distinct tokens, Config::max_recv_tokens is " << s.limit << skipped
               << "Raise max_recv_tokens";
            break;
        case StatusCode::kRecvRowsOverflow:
            os << "receive capacity exceeded in " << kernel << " call " << s.call << ": rank " << s.culprit_rank
               << " would receive " << s.value << " expert rows (padding included), Config::max_recv_rows is "
               << s.limit << skipped << "Raise max_recv_rows";
            break;
        case StatusCode::kInvalidExpert:
            os << "invalid expert id " << s.value << " at topk_idx[" << s.token << "][" << s.slot << "] in " << kernel
               << " call " << s.call << ": expected -1 (dropped) or 0.." << s.limit - 1 << "; the route was dropped";
            break;
        case StatusCode::kDuplicateExpert:
            os << "expert id " << s.value << " repeated at topk_idx[" << s.token << "][" << s.slot << "] in " << kernel
               << " call " << s.call << ": each token's top-k experts must be distinct; the repeat was dropped";
            break;
        case StatusCode::kCombineRoutingMismatch:
            os << kernel << " call " << s.call << " was given another topk_idx row for token " << s.token
               << " than its dispatch sent (row digest 0x" << std::hex << static_cast<uint32_t>(s.value)
               << ", the dispatch's 0x" << static_cast<uint32_t>(s.limit) << std::dec
               << "); that token's row of out was written as zeros. Pass the combine the topk_idx its dispatch was "
                  "given";
            break;
        case StatusCode::kCallMismatch:
            if (static_cast<KernelId>(s.kernel) == KernelId::kNormalCombine) {
                os << kernel << " call " << s.call << " on rank " << s.rank << " combined normal handle #" << s.value
                   << " of its Buffer, but rank " << s.culprit_rank << "'s partials came from its combine on handle #"
                   << s.limit << ": the ranks combine their handles in different orders. This rank's out of that "
                   << "call is zeros. Dispatch and combine the normal handles in the same order on every rank";
                break;
            }
            if (static_cast<KernelId>(s.kernel) == KernelId::kLowLatencyCombine) {
                os << kernel << " call " << s.call << " on rank " << s.rank
                   << " combined the rows of its low-latency dispatch call " << s.value << ", but rank "
                   << s.culprit_rank << " sent back rows of dispatch call " << s.limit
                   << ": the ranks combine their dispatches in different orders. This rank's out of that call is "
                      "zeros. Combine the low-latency handles in the order they were dispatched, the same on every "
                      "rank";
                break;
            }
            if (static_cast<KernelId>(s.kernel) == KernelId::kNormalDispatch) {
                os << kernel << " call " << s.call << " differs from rank " << s.culprit_rank << "'s: rank " << s.rank
                   << " dispatched on normal handle #" << s.value << " of its Buffer, rank " << s.culprit_rank
                   << " on handle #" << s.limit
                   << "; nothing was moved (every rank skipped the call; its combine returns zeros). Make the normal "
                      "handles, and dispatch on them, in the same order on every rank";
                break;
            }
            os << kernel << " call " << s.call << " differs from rank " << s.culprit_rank << "'s: "
               << describe_ll_call_mismatch(static_cast<uint32_t>(s.value), static_cast<uint32_t>(s.limit), s.rank,
                                            s.culprit_rank)
               << "; nothing was received (every rank skipped the call; its combine returns zeros). Every rank must "
                  "make the same low-latency calls with the same fp8 flag, on Buffers made with the same Config";
            break;
        default:
            os << "unknown status code " << static_cast<uint32_t>(s.code);
            break;
    }
    return os.str();
}

}  // namespace

std::string describe_status(const Status& s) { return describe_status_text(s, false); }

namespace detail {
std::string describe_status_one_rank_skipped(const Status& s) { return describe_status_text(s, true); }
}  // namespace detail

}  // namespace weft::ops::ep
