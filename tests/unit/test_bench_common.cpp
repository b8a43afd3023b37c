// SPDX-License-Identifier: MIT
// The benchmarks' shared command line and JSON writer (bench/common), on the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/json.hpp"
#include "common/ranks.hpp"
#include "common/timing.hpp"
#include "weft/runtime/error.hpp"

namespace weft::bench {
namespace {

// ---- JSON ----------------------------------------------------------------------------------------------------

TEST(BenchJson, EscapesQuotesBackslashesAndControlCharacters) {
    EXPECT_EQ(json_string(""), "\"\"");
    EXPECT_EQ(json_string("H200"), "\"H200\"");
    EXPECT_EQ(json_string("a\"b"), "\"a\\\"b\"");
    EXPECT_EQ(json_string("C:\\x\\"), "\"C:\\\\x\\\\\"");
    EXPECT_EQ(json_string("\b\f\n\r\t"), "\"\\b\\f\\n\\r\\t\"");
    EXPECT_EQ(json_string(std::string("a\0b", 3)), "\"a\\u0000b\"");
    EXPECT_EQ(json_string("\x01\x1f"), "\"\\u0001\\u001f\"");
    // DEL and bytes >= 0x80 (UTF-8) are legal in a JSON string as they are.
    EXPECT_EQ(json_string("\x7f"), "\"\x7f\"");
    EXPECT_EQ(json_string("\xc2\xb5s"), "\"\xc2\xb5s\"");
    EXPECT_EQ(json_string("\" injected\": 1, \""), "\"\\\" injected\\\": 1, \\\"\"");
}

TEST(BenchJson, NonFiniteNumbersAreNull) {
    EXPECT_EQ(json_number(std::numeric_limits<double>::quiet_NaN()), "null");
    EXPECT_EQ(json_number(std::numeric_limits<double>::infinity()), "null");
    EXPECT_EQ(json_number(-std::numeric_limits<double>::infinity()), "null");
}

TEST(BenchJson, NumbersRoundTrip) {
    EXPECT_EQ(json_number(0.0), "0");
    EXPECT_EQ(json_number(-1.5), "-1.5");
    EXPECT_EQ(json_number(0.1), "0.1");
    for (double v : {1.0 / 3.0, 712.34567891234, 6.02e23, 1e-300, -2.5e-7, 4.25e12}) {
        const std::string text = json_number(v);
        EXPECT_EQ(std::strtod(text.c_str(), nullptr), v) << text;
        EXPECT_EQ(text.find_first_not_of("0123456789.-+e"), std::string::npos) << text;
    }
}

TEST(BenchJson, WritesADocument) {
    Json j;
    j.begin_object().field("bench", "x\"y").field("n", 3).field("ok", true).field("none", nullptr);
    j.field("nan", std::nan("")).field("big", std::numeric_limits<uint64_t>::max());
    j.field("small", std::numeric_limits<int64_t>::min());
    j.key("rows").begin_array();
    j.begin_object(true).field("a", 1).key("v").begin_array().value(1.5).value("s").end_array().end_object();
    j.begin_object(true).end_object();
    j.end_array();
    j.key("empty").begin_array().end_array();
    j.end_object();
    EXPECT_EQ(j.str(),
              "{\n"
              "  \"bench\": \"x\\\"y\",\n"
              "  \"n\": 3,\n"
              "  \"ok\": true,\n"
              "  \"none\": null,\n"
              "  \"nan\": null,\n"
              "  \"big\": 18446744073709551615,\n"
              "  \"small\": -9223372036854775808,\n"
              "  \"rows\": [\n"
              "    {\"a\": 1, \"v\": [1.5, \"s\"]},\n"
              "    {}\n"
              "  ],\n"
              "  \"empty\": []\n"
              "}");
}

TEST(BenchJson, MisuseIsAnError) {
    {
        Json j;
        j.begin_object();
        EXPECT_THROW(j.value(1), std::logic_error);  // no key
        EXPECT_THROW(j.end_array(), std::logic_error);
        EXPECT_THROW(j.str(), std::logic_error);  // not closed
        j.key("k");
        EXPECT_THROW(j.key("again"), std::logic_error);
        EXPECT_THROW(j.end_object(), std::logic_error);  // a key without its value
        j.value(2).end_object();
        EXPECT_EQ(j.str(), "{\n  \"k\": 2\n}");
        EXPECT_THROW(j.value(3), std::logic_error);  // after the end
        EXPECT_THROW(j.end_object(), std::logic_error);
    }
    {
        Json j;
        j.begin_array();
        EXPECT_THROW(j.key("k"), std::logic_error);
        EXPECT_THROW(j.end_object(), std::logic_error);
    }
}

TEST(BenchJson, WritesAFileOrSaysWhyNot) {
    const std::string path = ::testing::TempDir() + "weft_bench_json_test.json";
    Json j;
    j.begin_object().field("a", 1).end_object();
    write_json_file(path, j);
    std::ifstream f(path);
    std::stringstream got;
    got << f.rdbuf();
    EXPECT_EQ(got.str(), "{\n  \"a\": 1\n}\n");
    std::remove(path.c_str());
    try {
        write_json_file("/nonexistent-dir/x/y.json", j);
        FAIL() << "no error for a path that cannot be written";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/x/y.json"), std::string::npos) << e.what();
    }
}

// ---- command line ----------------------------------------------------------------------------------------------

std::string usage_error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const UsageError& e) {
        return e.what();
    }
    return "";
}

struct Parsed {
    std::vector<uint64_t> sizes = {1, 2};
    int iters = 20, warmup = 3;
    DType dtype = DType::kBF16;
    std::vector<int> worlds = {2, 4};
    bool check = false, tune = false;
    std::string json, mode = "all";
    int ctas = 0;
};

void parse(Parsed& p, const std::vector<const char*>& options) {
    std::vector<const char*> args(options.size() + 1, "weft_bench_test");
    std::copy(options.begin(), options.end(), args.begin() + 1);
    Cli cli("weft_bench_test", "a test");
    cli.sizes("LIST", "bytes", [&](const std::string& v) { p.sizes = parse_byte_sizes(v, "--sizes"); });
    cli.iters(&p.iters).warmup(&p.warmup).dtype(&p.dtype, {DType::kBF16, DType::kF16});
    cli.world(&p.worlds, 2, 64).check(&p.check).json(&p.json);
    cli.flag("--tune", "tune", &p.tune);
    cli.option("--mode", "a|b|all", "mode", [&](const std::string& v) {
        p.mode = parse_choice(v, "--mode", {"a", "b", "all"});
    });
    cli.int_option("--ctas", "CTAs", &p.ctas, 0, 16);
    cli.parse(static_cast<int>(args.size()), args.data());
}

TEST(BenchCli, ParsesTheSharedAndOwnOptions) {
    Parsed p;
    parse(p, {});
    EXPECT_EQ(p.iters, 20);
    EXPECT_EQ(p.worlds, (std::vector<int>{2, 4}));
    EXPECT_FALSE(p.check);
    parse(p, {"--sizes", "4K,1M",  "--iters",  "7",      "--warmup", "0", "--dtype", "f16", "--world", "8,3",
              "--check", "--json", "out.json", "--tune", "--mode",   "b", "--ctas",  "16",  "--iters", "9"});
    EXPECT_EQ(p.sizes, (std::vector<uint64_t>{4096, 1 << 20}));
    EXPECT_EQ(p.iters, 9);  // the last value wins
    EXPECT_EQ(p.warmup, 0);
    EXPECT_EQ(p.dtype, DType::kF16);
    EXPECT_EQ(p.worlds, (std::vector<int>{8, 3}));
    EXPECT_TRUE(p.check);
    EXPECT_TRUE(p.tune);
    EXPECT_EQ(p.json, "out.json");
    EXPECT_EQ(p.mode, "b");
    EXPECT_EQ(p.ctas, 16);
}

TEST(BenchCli, BadCommandLinesNameTheOptionAndTheExpectation) {
    Parsed p;
    const auto err = [&](std::vector<const char*> args) { return usage_error_of([&] { parse(p, args); }); };
    EXPECT_EQ(err({"--bogus"}), "unknown option '--bogus'");
    EXPECT_EQ(err({"--iters"}), "--iters: needs a value (N)");
    EXPECT_EQ(err({"--iters", "0"}), "--iters: expected an integer in 1..2147483647, got '0'");
    EXPECT_EQ(err({"--iters", "x"}), "--iters: expected an integer in 1..2147483647, got 'x'");
    EXPECT_EQ(err({"--iters", "1.5"}), "--iters: expected an integer in 1..2147483647, got '1.5'");
    EXPECT_EQ(err({"--iters", "99999999999"}), "--iters: expected an integer in 1..2147483647, got '99999999999'");
    EXPECT_EQ(err({"--warmup", "-1"}), "--warmup: expected an integer in 0..2147483647, got '-1'");
    EXPECT_EQ(err({"--ctas", "17"}), "--ctas: expected an integer in 0..16, got '17'");
    EXPECT_EQ(err({"--dtype", "f32"}), "--dtype: expected one of bf16, f16; got 'f32'");
    EXPECT_EQ(err({"--world", "1"}), "--world: expected an integer in 2..64, got '1'");
    EXPECT_EQ(err({"--world", "2,x"}), "--world: expected an integer in 2..64, got 'x'");
    EXPECT_EQ(err({"--world", ","}), "--world: expected a comma-separated list of integers, got ','");
    EXPECT_EQ(err({"--mode", "c"}), "--mode: expected one of a, b, all; got 'c'");
    EXPECT_EQ(err({"--json", ""}), "--json: expected a file name");
    EXPECT_EQ(err({"--sizes", "4Q"}), "--sizes: expected a byte size such as 4096, 64K, 512M or 2G, got '4Q'");
    EXPECT_EQ(err({"--check", "--", "x"}), "unknown option '--'");
}

TEST(BenchCli, ByteSizes) {
    EXPECT_EQ(parse_byte_sizes("8,64,4K,2M,1G,1T", "--sizes"),
              (std::vector<uint64_t>{8, 64, 4096, 2u << 20, 1u << 30, 1ull << 40}));
    EXPECT_EQ(parse_byte_sizes("1K:64K", "--sizes"), (std::vector<uint64_t>{1024, 4096, 16384, 65536}));
    EXPECT_EQ(parse_byte_sizes("1K:8K:2", "--sizes"), (std::vector<uint64_t>{1024, 2048, 4096, 8192}));
    EXPECT_EQ(parse_byte_sizes("3:10", "--sizes"), (std::vector<uint64_t>{3}));
    EXPECT_EQ(parse_byte_sizes("4k", "--sizes"), (std::vector<uint64_t>{4096}));
    for (const char* bad : {"", "0", "1K:0", "4K:1K", "1K:1M:1", "1:2:3:4", "K", "-1", "1.5K", "16E", "1K:x"}) {
        EXPECT_NE(usage_error_of([&] { parse_byte_sizes(bad, "--sizes"); }).find("--sizes: "), std::string::npos)
            << "'" << bad << "' was accepted";
    }
    EXPECT_NE(usage_error_of([&] { parse_bytes("99999999999999999999", "--graph-max"); }).find("--graph-max"),
              std::string::npos);
    EXPECT_NE(usage_error_of([&] { parse_bytes("20000000T", "--graph-max"); }).find("--graph-max"), std::string::npos);
}

TEST(BenchCli, Shapes) {
    EXPECT_EQ(parse_shapes3("8192x8192x8192,1x16x32", "--sizes"),
              (std::vector<std::array<int64_t, 3>>{{8192, 8192, 8192}, {1, 16, 32}}));
    EXPECT_EQ(parse_shapes2("8192x4096", "--sizes"), (std::vector<std::array<int64_t, 2>>{{8192, 4096}}));
    for (const char* bad : {"", "8x8", "8x8x8x8", "8x0x8", "8xx8", "8x8x-1", "axbxc", "8X8X8", ","}) {
        const std::string e = usage_error_of([&] { parse_shapes3(bad, "--sizes"); });
        EXPECT_NE(e.find("--sizes: expected MxNxK"), std::string::npos) << "'" << bad << "': " << e;
    }
    EXPECT_NE(usage_error_of([&] { parse_shapes2("8x8x8", "--sizes"); }).find("expected AxB"), std::string::npos);
}

TEST(BenchCli, HeadPairs) {
    EXPECT_EQ(parse_head_pairs("96/12,32/8,4/4", "--heads", 16),
              (std::vector<std::array<int64_t, 2>>{{96, 12}, {32, 8}, {4, 4}}));
    EXPECT_EQ(usage_error_of([&] { parse_head_pairs("96", "--heads", 16); }), "--heads: expected Q/KV, got '96'");
    EXPECT_EQ(usage_error_of([&] { parse_head_pairs("96/10", "--heads", 16); }),
              "--heads: Q must be a multiple of KV with Q / KV <= 16, got '96/10'");
    EXPECT_EQ(usage_error_of([&] { parse_head_pairs("64/2", "--heads", 16); }),
              "--heads: Q must be a multiple of KV with Q / KV <= 16, got '64/2'");
    EXPECT_EQ(usage_error_of([&] { parse_head_pairs("0/1", "--heads", 16); }),
              "--heads: expected an integer in 1..4096, got '0'");
    EXPECT_EQ(usage_error_of([&] { parse_head_pairs(",", "--heads", 16); }),
              "--heads: expected Q/KV[,Q/KV...], got ','");
}

TEST(BenchCli, IntsChoicesAndDtypes) {
    EXPECT_EQ(parse_int("-5", "--x", -10, 10), -5);
    EXPECT_EQ(parse_int_list("1,2,3", "--x", 1, 3), (std::vector<int64_t>{1, 2, 3}));
    EXPECT_EQ(parse_choice_list("a,b,a", "--x", {"a", "b"}), (std::vector<std::string>{"a", "b", "a"}));
    EXPECT_EQ(parse_dtype("f32", "--dtype", {DType::kF32, DType::kU8}), DType::kF32);
    EXPECT_EQ(usage_error_of([&] { parse_int("", "--x", 0, 1); }), "--x: expected an integer in 0..1, got ''");
    EXPECT_EQ(usage_error_of([&] { parse_int(" 1", "--x", 0, 1); }), "--x: expected an integer in 0..1, got ' 1'");
    EXPECT_EQ(usage_error_of([&] {
                  parse_choice_list("a,c", "--x", {"a", "b"});
              }),
              "--x: expected one of a, b; got 'c'");
    EXPECT_EQ(split(",a,,b,", ','), (std::vector<std::string>{"a", "b"}));
}

TEST(BenchCli, PlacementIsSharedOrSpreadAndSpreadNeedsTwoGpus) {
    const auto parse_placement = [](const std::vector<const char*>& options) {
        std::vector<const char*> args(options.size() + 1, "weft_bench_test");
        std::copy(options.begin(), options.end(), args.begin() + 1);
        Placement p = Placement::kShared;
        Cli cli("weft_bench_test", "a test");
        cli.placement(&p);
        cli.parse(static_cast<int>(args.size()), args.data());
        return p;
    };
    EXPECT_EQ(parse_placement({}), Placement::kShared);
    EXPECT_EQ(parse_placement({"--placement", "spread"}), Placement::kSpread);
    EXPECT_EQ(parse_placement({"--placement", "spread", "--placement", "shared"}), Placement::kShared);
    EXPECT_EQ(usage_error_of([&] {
                  parse_placement({"--placement", "Spread"});
              }),
              "--placement: expected one of shared, spread; got 'Spread'");
    EXPECT_EQ(usage_error_of([&] { parse_placement({"--placement"}); }), "--placement: needs a value (shared|spread)");
    EXPECT_STREQ(placement_name(Placement::kShared), "shared");
    EXPECT_STREQ(placement_name(Placement::kSpread), "spread");

    EXPECT_NO_THROW(check_placement(Placement::kShared, 1));
    EXPECT_NO_THROW(check_placement(Placement::kSpread, 2));
    EXPECT_NO_THROW(check_placement(Placement::kSpread, 8));
    EXPECT_EQ(usage_error_of([] { check_placement(Placement::kSpread, 1); }),
              "--placement spread needs at least 2 visible GPUs, found 1");
    EXPECT_EQ(usage_error_of([] { check_placement(Placement::kSpread, 0); }),
              "--placement spread needs at least 2 visible GPUs, found 0");

    Placement p = Placement::kShared;
    Cli cli("weft_bench_test", "a test");
    const std::string u = cli.placement(&p).usage();
    EXPECT_NE(u.find("--placement shared|spread"), std::string::npos) << u;
    EXPECT_NE(u.find("default shared"), std::string::npos) << u;
}

TEST(BenchCli, UsageListsEveryOption) {
    int iters = 5;
    bool flag = false;
    Cli cli("weft_bench_x", "what it measures");
    cli.iters(&iters).flag("--all-configs", "one row per config", &flag);
    const std::string u = cli.usage();
    EXPECT_EQ(u.rfind("usage: weft_bench_x [options]\nwhat it measures\n", 0), 0u) << u;
    EXPECT_NE(u.find("--iters N"), std::string::npos) << u;
    EXPECT_NE(u.find("default 5"), std::string::npos) << u;
    EXPECT_NE(u.find("--all-configs"), std::string::npos) << u;
    EXPECT_NE(u.find("--help"), std::string::npos) << u;
    EXPECT_THROW(cli.flag("--all-configs", "again", &flag), std::logic_error);
}

TEST(BenchCli, RunMainTurnsErrorsIntoExitStatuses) {
    EXPECT_EQ(run_main("b", [] { return 0; }), 0);
    EXPECT_EQ(run_main("b", [] { return 1; }), 1);
    EXPECT_EQ(run_main("b", []() -> int { throw UsageError("--x: bad"); }), 2);
    EXPECT_EQ(run_main("b", []() -> int { throw Error("no GPU"); }), 1);
}

// ---- timing helpers (host arithmetic) ------------------------------------------------------------------------

TEST(BenchRanks, WorldsAreTheRequestedOnesWithThreadsAndTheLaunchedOneUnderALauncher) {
    RankLauncher threads;
    EXPECT_FALSE(threads.launched());
    EXPECT_TRUE(threads.printer());
    EXPECT_EQ(threads.worlds({}, {2, 4, 8}), (std::vector<int>{2, 4, 8}));
    EXPECT_EQ(threads.worlds({3}, {2, 4, 8}), (std::vector<int>{3}));
    RankLauncher launched;
    launched.env = LaunchEnv{};
    launched.env->rank = 1;
    launched.env->num_ranks = 4;
    launched.env->launcher = "weftrun";
    EXPECT_TRUE(launched.launched());
    EXPECT_FALSE(launched.printer());
    EXPECT_EQ(launched.worlds({}, {2, 4, 8}), (std::vector<int>{4}));
    EXPECT_EQ(launched.worlds({4}, {2, 4, 8}), (std::vector<int>{4}));
    EXPECT_EQ(usage_error_of([&] {
                  launched.worlds({2, 4}, {2});
              }),
              "--world: weftrun started 4 processes, one rank each: leave --world out or pass --world 4");
    EXPECT_EQ(usage_error_of([&] { launched.worlds({8}, {2}); }),
              "--world: weftrun started 4 processes, one rank each: leave --world out or pass --world 4");
}

TEST(BenchTiming, MedianAndMean) {
    EXPECT_EQ(median({}), 0.0);
    EXPECT_EQ(median({3.0}), 3.0);
    EXPECT_EQ(median({5.0, 1.0, 4.0}), 4.0);
    EXPECT_EQ(median({4.0, 1.0, 3.0, 2.0}), 3.0);  // the upper middle of an even count
    EXPECT_EQ(mean({1.0, 2.0, 6.0}), 3.0);
    EXPECT_EQ(mean({}), 0.0);
}

TEST(BenchTiming, ColdL2SetsCoverThreeTimesTheL2) {
    const size_t l2 = 60u << 20;
    EXPECT_EQ(cold_l2_sets(1u << 20, l2), 32);         // clamped to the most
    EXPECT_EQ(cold_l2_sets(size_t{1} << 30, l2), 2);   // at least two
    EXPECT_EQ(cold_l2_sets(32u << 20, l2), 6);         // 6 x 32 MiB >= 3 x 60 MiB > 5 x 32 MiB
    EXPECT_EQ(cold_l2_sets(45u << 20, l2, 1, 64), 4);  // exactly 3 x L2
    EXPECT_EQ(cold_l2_sets(0, l2, 2, 8), 8);
}

TEST(BenchTiming, PoolRotationVisitsDistinctAlignedSlots) {
    const PoolRotation r(256u << 20, 1000);
    EXPECT_EQ(r.stride(), 1024u);
    EXPECT_EQ(r.slots(), (256u << 20) / 1024u);
    EXPECT_EQ(r.offset(0), 0u);
    EXPECT_EQ(r.offset(1), 1024u);
    EXPECT_EQ(r.offset(static_cast<int64_t>(r.slots())), 0u);  // wraps around
    const PoolRotation capped(256u << 20, 4096, 64);
    EXPECT_EQ(capped.slots(), 64u);
    EXPECT_EQ(capped.offset(65), 4096u);
    const PoolRotation one(1u << 20, 3u << 20);  // an item larger than the pool: one slot
    EXPECT_EQ(one.slots(), 1u);
    EXPECT_EQ(one.offset(7), 0u);
}

}  // namespace
}  // namespace weft::bench
