// SPDX-License-Identifier: MIT
// weft::ops::FusedGemm: the fused GEMMs' config choice, JIT specs, call set-up.
#include "weft/ops/fused_gemm.hpp"

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <system_error>

#include "views_overlap.hpp"
#include "weft/detail/rendezvous_protocol.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {
namespace {

// Per tile, the fused GEMMs' hooks (chunk waits before its loads, a stored signal after its stores) cost about as
// much as 1024 more output elements of MMA (3% of a 128x256 tile), which favours the larger tiles more than the plain
// GEMM's cost model does: with it the fused ops keep the tiles the autotuner measured fastest where the plain model
// alone would pick smaller ones (docs/performance_archive.md, "Overlapped tensor-parallel kernels").
constexpr double kHookedTileCost = 1024;

bool is_identifier_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// `text` with every token CFG (not part of a longer identifier) replaced by `cfg`.
std::string replace_cfg(const std::string& text, const std::string& cfg) {
    std::string out;
    size_t i = 0;
    while (i < text.size()) {
        const size_t pos = text.find("CFG", i);
        if (pos == std::string::npos) break;
        const bool starts = pos == 0 || !is_identifier_char(text[pos - 1]);
        const bool ends = pos + 3 == text.size() || !is_identifier_char(text[pos + 3]);
        out.append(text, i, pos - i);
        out.append(starts && ends ? cfg : std::string("CFG"));
        i = pos + 3;
    }
    out.append(text, i, std::string::npos);
    return out;
}

}  // namespace

FusedGemmSpec plain_gemm_fused_spec() {
    FusedGemmSpec spec;
    spec.header = "gemm/gemm_sm90.cuh";
    spec.scheduler = "weft::kernels::gemm::PersistentScheduler";
    spec.hook = "weft::kernels::gemm::NoEpilogueHook";
    spec.name = "plain_gemm";
    return spec;
}

std::vector<GemmConfig> fused_gemm_candidates(DType in, DType out, int64_t rows_multiple) {
    std::vector<GemmConfig> list;
    for (GemmConfig c : gemm_candidate_configs(in, out, BLayout::kNK)) {
        c.cluster_m = c.cluster_n = 1;
        if (!is_valid(c) || !gemm_whole_store_boxes(c)) continue;
        if (rows_multiple > 0 && rows_multiple % c.tile_m != 0) continue;
        if (std::find(list.begin(), list.end(), c) == list.end()) list.push_back(c);
    }
    return list;
}

namespace detail {

std::string config_text(const GemmConfig& c) {
    std::ostringstream os;
    os << c.tile_m << "x" << c.tile_n << "x" << c.tile_k << "/" << c.stages << (c.pingpong ? " ping-pong " : " ")
       << dtype_name(c.in_dtype) << "->" << dtype_name(c.out_dtype);
    return os.str();
}

std::optional<GemmConfig> cheapest_fused_gemm_config(const GemmProblem& problem, int budget, int64_t rows_multiple) {
    std::optional<GemmConfig> best;
    double best_cost = 0;
    for (const GemmConfig& cand : fused_gemm_candidates(problem.in_dtype, problem.out_dtype, rows_multiple)) {
        const double cost = gemm_config_cost(problem, cand, budget, kHookedTileCost);
        if (!best || cost < best_cost * 0.999) {
            best = cand;
            best_cost = cost;
        }
    }
    return best;
}

FusedGemmCall make_fused_gemm_call(const GemmConfig& config, const TensorView& a, const TensorView& b,
                                   const TensorView& d, int grid, uint64_t timeout_ns) {
    FusedGemmCall call;
    call.maps = make_gemm_tensor_maps(config, a, b, d);
    call.args = make_gemm_args(a, d, timeout_ns);
    call.grid = grid;
    call.config = config;
    call.prepared = true;
    return call;
}

void rethrow_with_op(const std::string& op, const std::exception& e) {
    std::string what = e.what();
    const std::string prefix = "weft: ";
    if (what.rfind(prefix, 0) == 0) what = what.substr(prefix.size());
    throw Error(prefix + op + ": " + what);
}

}  // namespace detail

GemmConfig fused_gemm_config(const GemmProblem& problem, int budget) {
    WEFT_CHECK(budget >= 1, "fused_gemm_config: budget must be >= 1 SM, got " << budget);
    const std::optional<GemmConfig> best = detail::cheapest_fused_gemm_config(problem, budget);
    WEFT_CHECK(best.has_value(), "fused_gemm_config: no fused GEMM config takes " << dtype_name(problem.in_dtype)
                                                                                   << " inputs and writes "
                                                                                   << dtype_name(problem.out_dtype));
    return *best;
}

void check_fused_gemm_config(const GemmConfig& c) {
    WEFT_CHECK(is_valid(c), "fused_gemm: the config is not a valid GemmConfig: " << format_gemm_config(c));
    WEFT_CHECK(c.cluster_m == 1 && c.cluster_n == 1, "fused_gemm: the config must be cluster-free (cluster_m = "
                                                     "cluster_n = 1), got " << format_gemm_config(c));
    WEFT_CHECK(c.splits == 1,
               "fused_gemm: the config must not split K (splits = 1: a hook sees each tile once, "
               "whole), got "
                   << format_gemm_config(c));
    WEFT_CHECK(!c.swap_ab,
               "fused_gemm: a swapped config (swap_ab) serves the plain GEMM only (its hooks signal and "
               "route whole row slabs), got "
                   << format_gemm_config(c));
    WEFT_CHECK(gemm_whole_store_boxes(c), "fused_gemm: the config must have a tile_n of whole "
                                              << gemm_epi_cols(c)
                                              << "-column store boxes (hooks signal every store), got "
                                              << format_gemm_config(c));
}

int fused_gemm_grid(const GemmConfig& config, int64_t m, int64_t n, int budget) {
    const GemmTileGrid g(config, static_cast<int32_t>(m), static_cast<int32_t>(n));
    return std::max(1, std::min(budget, g.num_tiles()));
}

uint64_t fused_gemm_timeout_ns(const World& world) {
    // Twice the World's bound, at most the 30 days any device bound may be.
    const auto ms = static_cast<uint64_t>(std::max<int64_t>(1, world.timeout().count()));
    return std::min<uint64_t>(2 * ms, static_cast<uint64_t>(weft::detail::rendezvous::kMaxWaitMs)) * 1000000ull;
}

uint64_t fused_gemm_timeout_ns(const Team& team) { return fused_gemm_timeout_ns(team.world()); }

jit::KernelSpec fused_gemm_kernel_spec(const FusedGemmSpec& spec, const GemmConfig& config, const std::string& arch) {
    const std::string name = spec.name.empty() ? "fused_gemm" : spec.name;
    WEFT_CHECK(!spec.header.empty(), name << ": FusedGemmSpec.header must name the header to compile");
    WEFT_CHECK(!spec.kernel_template.empty() || (!spec.scheduler.empty() && !spec.hook.empty()),
               name << ": FusedGemmSpec.scheduler and .hook must name a scheduler template and a hook type, got '"
                    << spec.scheduler << "' and '" << spec.hook << "'");
    check_fused_gemm_config(config);
    const std::string cfg = format_gemm_config(config);
    jit::KernelSpec k;
    k.header = spec.header;
    k.instantiation = spec.kernel_template.empty()
                          ? gemm_kernel_instantiation(config, spec.scheduler, replace_cfg(spec.hook, cfg))
                          : replace_cfg(spec.kernel_template, cfg);
    // A header of the user's own names the scheduler and hook only; weft's kernel headers include the kernel.
    if (!spec.include_root.empty()) k.extra_code = "#include <gemm/gemm_sm90.cuh>";
    k.description = name + " " + detail::config_text(config);
    k.arch = arch;
    return k;
}

jit::Compiler& fused_gemm_compiler(const std::filesystem::path& include_root) {
    std::error_code ec;
    WEFT_CHECK(include_root.empty() || std::filesystem::is_directory(include_root, ec),
               "fused_gemm: FusedGemmSpec::include_root must be a directory, got '" << include_root.string() << "'");
    return jit::compiler(include_root);
}

FusedGemm::FusedGemm(const Team& team, const FusedGemmSpec& spec, const GemmConfig& config)
    : world_(nullptr), spec_(spec), config_(config), kernel_(nullptr) {
    team.require_member(spec.name.empty() ? "fused_gemm" : spec.name);
    world_ = &team.world();
    kernel_ = &fused_gemm_compiler(spec.include_root).get_kernel(fused_gemm_kernel_spec(spec, config));
}

FusedGemm::FusedGemm(World& world, const FusedGemmSpec& spec, const GemmConfig& config)
    : FusedGemm(world.team(), spec, config) {}

namespace detail {

namespace {
// `reads_epoch`: whether the scheduler or hook reads `epoch` in SignalValueMode::kEpoch.
void check_value_mode(gemm::SignalValueMode mode, const uint64_t* epoch, bool reads_epoch, const char* type) {
    WEFT_CHECK(mode == gemm::SignalValueMode::kArgument || mode == gemm::SignalValueMode::kEpoch,
               "fused_gemm: " << type << "::value_mode must be kArgument or kEpoch, got " << static_cast<int>(mode));
    WEFT_CHECK(
        mode != gemm::SignalValueMode::kEpoch || !reads_epoch || epoch != nullptr,
        "fused_gemm: " << type << "::value_mode kEpoch reads the call counter " << type << "::epoch, which is null");
}
}  // namespace

void check_fused_gemm_params(const gemm::ChunkWaitParams& p, const FusedGemmCall& /*call*/) {
    WEFT_CHECK(p.flags != nullptr, "fused_gemm: ChunkWaitParams::flags (one signal per chunk of A rows) is null");
    WEFT_CHECK(p.rows_per_chunk >= 1,
               "fused_gemm: ChunkWaitParams::rows_per_chunk must be >= 1, got " << p.rows_per_chunk);
    check_value_mode(p.value_mode, p.epoch, true, "ChunkWaitParams");
}

void check_fused_gemm_params(const gemm::TileSignalParams& p, const FusedGemmCall& call) {
    WEFT_CHECK(p.flags != nullptr, "fused_gemm: TileSignalParams::flags is null");
    WEFT_CHECK(
        p.mode == gemm::TileSignalMode::kSetPerTile || p.mode == gemm::TileSignalMode::kAddPerTileRow,
        "fused_gemm: TileSignalParams::mode must be kSetPerTile or kAddPerTileRow, got " << static_cast<int>(p.mode));
    const int64_t n_tiles = (int64_t{call.args.n} + call.config.tile_n - 1) / call.config.tile_n;
    WEFT_CHECK(p.mode != gemm::TileSignalMode::kSetPerTile || p.num_n_tiles >= n_tiles,
               "fused_gemm: TileSignalParams::num_n_tiles (the per-tile flags' row length) must be at least the "
                   << n_tiles << " tiles of N = " << call.args.n << " in tile_n " << call.config.tile_n << ", got "
                   << p.num_n_tiles);
    // kAddPerTileRow adds `value` in both value modes: only kSetPerTile reads the epoch.
    check_value_mode(p.value_mode, p.epoch, p.mode == gemm::TileSignalMode::kSetPerTile, "TileSignalParams");
}

}  // namespace detail

void FusedGemm::check_prepared_for_this(const FusedGemmCall& call) const {
    if (call.prepared && call.config == config_) return;  // every call: no string built
    const std::string name = spec_.name.empty() ? "fused_gemm" : spec_.name;
    WEFT_CHECK(call.prepared, name << ": the call was not made by FusedGemm::prepare (launch(prepare(a, b, d), "
                                      "...))");
    WEFT_CHECK(call.config == config_, name << ": the call was prepared for " << format_gemm_config(call.config)
                                            << ", this FusedGemm runs " << format_gemm_config(config_)
                                            << ": prepare it with the FusedGemm that launches it");
}

FusedGemmCall FusedGemm::prepare(const TensorView& a, const TensorView& b, const TensorView& d, int max_ctas) const {
    const std::string name = spec_.name.empty() ? "fused_gemm" : spec_.name;
    GemmProblem p;
    try {
        p = validate_gemm_args(a, b, d, config_.b_layout);
    } catch (const Error& e) {
        detail::rethrow_with_op(name, e);
    }
    WEFT_CHECK(p.m >= 1 && p.n >= 1, name << ": a and d must have at least one row and b one output column, got M = "
                                          << p.m << ", N = " << p.n);
    WEFT_CHECK(p.in_dtype == config_.in_dtype && p.out_dtype == config_.out_dtype,
               name << ": the views must be " << dtype_name(config_.in_dtype) << " (a, b) and "
                    << dtype_name(config_.out_dtype) << " (d), the config's dtypes, got " << dtype_name(p.in_dtype)
                    << " and " << dtype_name(p.out_dtype));
    WEFT_CHECK(max_ctas >= 0 && max_ctas <= world_->sm_budget(),
               name << ": max_ctas must be in [0, World::sm_budget() = " << world_->sm_budget()
                    << "] (0 = the budget; a persistent kernel that waits must stay resident), got " << max_ctas);
    detail::check_apart(name.c_str(), "d", d, {{"a", a}, {"b", b}},
                        "d is written while the GEMM's other tiles still read them");
    const int budget = max_ctas > 0 ? max_ctas : world_->sm_budget();
    return detail::make_fused_gemm_call(config_, a, b, d, fused_gemm_grid(config_, p.m, p.n, budget),
                                        fused_gemm_timeout_ns(*world_));
}

}  // namespace weft::ops
