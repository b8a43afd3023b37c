// SPDX-License-Identifier: MIT
// The benchmarks' command line: the shared options (--sizes --iters --warmup --dtype --world --check --json) with
// one spelling and one meaning everywhere, each benchmark's own options, value parsers, and main()'s error handling.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "weft/common/dtype.hpp"

namespace weft::bench {

/// A bad command line: an unknown option, a missing value, or a value out of range. The message names the option.
class UsageError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

/// Where a benchmark's ranks, threads of this process, run. kShared: every rank on GPU 0, so a peer's memory is local
/// HBM and a same-GPU copy is the roofline. kSpread: rank r on visible GPU r % num_devices (run_local's default), so a
/// peer on another GPU is reached over NVLink or PCIe; a world of more ranks than GPUs goes over them round robin.
enum class Placement { kShared, kSpread };

/// Parses argv into the variables it was given. Each option is registered with the variable it sets, whose value
/// at registration is the default shown by --help. Options may come in any order; a repeated option's last value
/// wins. parse() throws UsageError on an unknown option, a missing value or a bad value; --help (-h) prints the
/// usage and exits with status 0.
///
///     Cli cli("weft_bench_ep", "expert-parallel dispatch and combine");
///     cli.iters(&o.iters).warmup(&o.warmup).check(&o.check).json(&o.json);
///     cli.option("--mode", "ll|normal|all", "which kernels", [&](const std::string& v) { o.mode = v; });
///     cli.parse(argc, argv);
class Cli {
public:
    using Setter = std::function<void(const std::string& value)>;

    Cli(std::string program, std::string summary);

    // The shared options. A benchmark registers those that apply to it.
    /// --sizes: what a size is differs by benchmark (bytes, MxNxK, NxK); `set` parses it (see the parsers below).
    Cli& sizes(const std::string& metavar, const std::string& help, Setter set);
    /// --iters N: timed iterations, N >= 1.
    Cli& iters(int* out);
    /// --warmup N: untimed iterations first, N >= 0.
    Cli& warmup(int* out);
    /// --dtype T: one of `allowed`.
    Cli& dtype(DType* out, std::vector<DType> allowed);
    /// --world N[,N...]: world sizes in [lo, hi].
    Cli& world(std::vector<int>* out, int lo, int hi);
    /// --world N: one world size in [lo, hi] (`help` says what the value means to this benchmark).
    Cli& world(int* out, int lo, int hi, const std::string& help);
    /// --check: verify results against a reference.
    Cli& check(bool* out);
    /// --json FILE: write every row to FILE.
    Cli& json(std::string* out);
    /// --placement shared|spread: which GPUs the ranks (threads of this process) run on (Placement).
    Cli& placement(Placement* out);

    // A benchmark's own options.
    Cli& flag(const std::string& name, const std::string& help, bool* out);
    Cli& option(const std::string& name, const std::string& metavar, const std::string& help, Setter set);
    Cli& int_option(const std::string& name, const std::string& help, int* out, int lo, int hi);

    void parse(int argc, const char* const* argv);
    void parse(int argc, char** argv) { parse(argc, const_cast<const char* const*>(argv)); }
    std::string usage() const;
    const std::string& program() const { return program_; }

private:
    struct Option {
        std::string name, metavar, help;
        Setter set;  // null for a flag
        bool* flag = nullptr;
    };
    Cli& add(Option o);
    std::string program_, summary_;
    std::vector<Option> options_;
};

/// "shared" or "spread".
const char* placement_name(Placement p);
/// Throws UsageError naming --placement when `p` cannot run with `num_devices` visible GPUs: spread needs two.
void check_placement(Placement p, int num_devices);

// Value parsers: each throws UsageError naming `option` and what it expects.

/// A decimal integer in [lo, hi].
int64_t parse_int(const std::string& text, const std::string& option, int64_t lo, int64_t hi);
/// Comma-separated integers in [lo, hi] (at least one).
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& option, int64_t lo, int64_t hi);
/// A byte count: digits with an optional K, M, G or T suffix (powers of 1024).
uint64_t parse_bytes(const std::string& text, const std::string& option);
/// Byte sizes: "4K,1M,3G", or "A:B" (A, 4A, 16A, ... up to B), or "A:B:F" (factor F >= 2); all >= 1.
std::vector<uint64_t> parse_byte_sizes(const std::string& text, const std::string& option);
/// Shapes "MxNxK[,MxNxK...]" with every extent >= 1.
std::vector<std::array<int64_t, 3>> parse_shapes3(const std::string& text, const std::string& option);
/// Shapes "AxB[,AxB...]" with both extents >= 1.
std::vector<std::array<int64_t, 2>> parse_shapes2(const std::string& text, const std::string& option);
/// Attention head pairs "Q/KV[,Q/KV...]" (query heads / KV heads, each in [1, 4096]) with Q a multiple of KV and at
/// most `max_group` query heads per KV head (at least one pair); {Q, KV} each.
std::vector<std::array<int64_t, 2>> parse_head_pairs(const std::string& text, const std::string& option,
                                                     int64_t max_group);
/// One of `allowed`.
std::string parse_choice(const std::string& text, const std::string& option, const std::vector<std::string>& allowed);
/// Comma-separated values, each one of `allowed` (at least one).
std::vector<std::string> parse_choice_list(const std::string& text, const std::string& option,
                                           const std::vector<std::string>& allowed);
/// A dtype name ("bf16", "f16", ...) among `allowed`.
DType parse_dtype(const std::string& text, const std::string& option, const std::vector<DType>& allowed);
/// Splits at `sep`, dropping empty items.
std::vector<std::string> split(const std::string& text, char sep);

/// Runs a benchmark's body and turns its exceptions into an exit status: a UsageError prints
/// "program: message (see --help)" and gives 2, any other exception "program: message" and 1; otherwise the body's
/// status (0: done and every check passed, 1: a check failed).
int run_main(const char* program, const std::function<int()>& body);

}  // namespace weft::bench
