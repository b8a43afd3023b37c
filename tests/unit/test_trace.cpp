// SPDX-License-Identifier: MIT
// Unit tests for the intra-kernel trace: the rank blobs and the Chrome-trace JSON (read back by a JSON parser), the
// environment, and that a kernel compiled without WEFT_TRACE is exactly the kernel without the instrumentation
// (same SASS) while a traced one records.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "support/sass_testing.hpp"
#include "weft/detail/collectives.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/jit/options.hpp"
#include "weft/jit/paths.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/ep.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/trace.hpp"

namespace weft {
namespace {

namespace fs = std::filesystem;
using testing::ScopedEnv;
using testing::TempDir;

TraceEvent event(TraceKind kind, TraceRole role, uint16_t sm, uint64_t begin, uint64_t end, int32_t a0 = 0,
                 int32_t a1 = 0, int32_t a2 = 0, int32_t a3 = 0) {
    TraceEvent e{};
    e.kind = static_cast<uint16_t>(kind);
    e.role = static_cast<uint8_t>(role);
    e.sm = sm;
    e.begin_ns = begin;
    e.end_ns = end;
    e.block = sm;
    e.args[0] = a0;
    e.args[1] = a1;
    e.args[2] = a2;
    e.args[3] = a3;
    return e;
}

std::vector<detail::RankTrace> two_ranks() {
    detail::RankTrace r0;
    r0.rank = 0;
    r0.host = "node-a";
    r0.recorded = 5;
    r0.events = {event(TraceKind::kWaitChunk, TraceRole::kProducer, 3, 1'000'000'500, 1'000'002'000, 2, 3, 1, 0),
                 event(TraceKind::kTile, TraceRole::kConsumer0, 3, 1'000'002'500, 1'000'010'000, 1, 0),
                 event(TraceKind::kTile, TraceRole::kConsumer1, 3, 1'000'002'500, 1'000'010'250, 1, 0),
                 event(TraceKind::kCopyChunk, TraceRole::kCopyEngine, 0, 1'000'000'000, 1'000'001'900, 2, 1),
                 event(TraceKind::kNotify, TraceRole::kProducer, 0, 1'000'011'000, 1'000'011'100, -1, -1)};
    detail::RankTrace r1;
    r1.rank = 1;
    r1.host = "node-a";
    r1.recorded = 4;  // two dropped
    r1.events = {event(TraceKind::kReduce, TraceRole::kComm, 7, 1'000'003'000, 1'000'004'000, 0, 0),
                 event(TraceKind::kWaitPeers, TraceRole::kProducer, 0, 1'000'012'000, 1'000'013'000, 1)};
    return {r0, r1};
}

bool have_python() { return std::system("python3 -c 'import json' >/dev/null 2>&1") == 0; }

/// Parses `json_path` with Python's json module and prints, one per line and sorted: every process name, every thread
/// name, every complete event as "pid|thread name|event name|ts|dur".
std::string summary_by_python(const fs::path& json_path, const fs::path& out_path) {
    const std::string script =
        "import json,sys\n"
        "d=json.load(open(sys.argv[1]))\n"
        "ev=d['traceEvents']\n"
        "threads={(e['pid'],e['tid']):e['args']['name'] for e in ev if e['ph']=='M' and e['name']=='thread_name'}\n"
        "lines=['process %d %s'%(e['pid'],e['args']['name']) for e in ev if e['ph']=='M' and "
        "e['name']=='process_name']\n"
        "lines+=['thread %d %s'%(k[0],v) for k,v in threads.items()]\n"
        "lines+=['X %d|%s|%s|%.3f|%.3f'%(e['pid'],threads[(e['pid'],e['tid'])],e['name'],e['ts'],e['dur']) "
        "for e in ev if e['ph']=='X']\n"
        "open(sys.argv[2],'w').write('\\n'.join(sorted(lines))+'\\n')\n";
    const fs::path script_path = out_path.parent_path() / "summary.py";
    testing::write_text_file(script_path, script);
    const std::string cmd = "python3 " + script_path.string() + " " + json_path.string() + " " + out_path.string();
    if (std::system(cmd.c_str()) != 0) return "(python could not parse the trace)";
    return testing::read_text_file(out_path);
}

TEST(TraceWriter, JsonReadsBackWithAProcessPerRankATrackPerSmAndRoleAndNamedEvents) {
    if (!have_python()) GTEST_SKIP() << "SKIPPED: python3 with its json module is needed to read the trace back";
    TempDir dir("weft_trace");
    const std::string json = detail::chrome_trace_json(two_ranks());
    testing::write_text_file(dir / "trace.json", json);
    const std::string got = summary_by_python(dir / "trace.json", dir / "summary.txt");
    // Times: microseconds from the earliest event of all ranks (rank 0's copy at 1'000'000'000 ns).
    const std::string want =
        "X 0|SM 0 producer|notify|11.000|0.100\n"
        "X 0|SM 3 consumer 0|tile (1, 0)|2.500|7.500\n"
        "X 0|SM 3 consumer 1|tile (1, 0)|2.500|7.750\n"
        "X 0|SM 3 producer|wait chunks 2-3|0.500|1.500\n"
        "X 0|copy engine 0|copy chunk 2|0.000|1.900\n"
        "X 1|SM 0 producer|wait peers|12.000|1.000\n"
        "X 1|SM 7 comm|reduce|3.000|1.000\n"
        "process 0 rank 0 (node-a)\n"
        "process 1 rank 1 (node-a; 2 events dropped)\n"
        "thread 0 SM 0 producer\n"
        "thread 0 SM 3 consumer 0\n"
        "thread 0 SM 3 consumer 1\n"
        "thread 0 SM 3 producer\n"
        "thread 0 copy engine 0\n"
        "thread 1 SM 0 producer\n"
        "thread 1 SM 7 comm\n";
    EXPECT_EQ(got, want) << json;
}

TEST(TraceWriter, AClockOffsetShiftsARanksEventsAndAnEmptyTraceIsValid) {
    if (!have_python()) GTEST_SKIP() << "SKIPPED: python3 with its json module is needed to read the trace back";
    TempDir dir("weft_trace");
    auto ranks = two_ranks();
    ranks[1].clock_offset_ns = 500;  // rank 1's clock runs 500 ns behind rank 0's
    testing::write_text_file(dir / "shifted.json", detail::chrome_trace_json(ranks));
    const std::string got = summary_by_python(dir / "shifted.json", dir / "shifted.txt");
    EXPECT_NE(got.find("X 1|SM 7 comm|reduce|3.500|1.000"), std::string::npos) << got;
    EXPECT_NE(got.find("X 0|copy engine 0|copy chunk 2|0.000|1.900"), std::string::npos) << got;

    testing::write_text_file(dir / "empty.json", detail::chrome_trace_json({}));
    EXPECT_EQ(summary_by_python(dir / "empty.json", dir / "empty.txt"), "\n");
}

TEST(TraceWriter, CollectiveAndEpEventsAreNamedAfterTheirPeerChunkOrSource) {
    const auto name = [](TraceKind kind, int32_t a0, int32_t a1 = 0) {
        return detail::trace_event_name(event(kind, TraceRole::kComm, 0, 0, 1, a0, a1));
    };
    EXPECT_EQ(name(TraceKind::kWaitPeer, 3, 120), "wait peer 3");
    EXPECT_EQ(name(TraceKind::kPushChunk, 5, 2), "push chunk 5 to 2");
    EXPECT_EQ(name(TraceKind::kPushChunk, 5, -1), "push chunk 5");
    EXPECT_EQ(name(TraceKind::kPullChunk, 4, 1), "pull chunk 4 from 1");
    EXPECT_EQ(name(TraceKind::kStage, 7), "stage chunk 7");
    EXPECT_EQ(name(TraceKind::kSend, 6, 40), "send to 6");
    EXPECT_EQ(name(TraceKind::kSend, -1, 40), "send");
    EXPECT_EQ(name(TraceKind::kRecv, 0, 12), "recv from 0");
    EXPECT_EQ(name(TraceKind::kRecv, -1, 12), "recv");
    EXPECT_EQ(name(TraceKind::kLayout, 128), "layout");
    EXPECT_EQ(name(TraceKind::kCombine, 128), "combine");
    EXPECT_EQ(name(TraceKind::kReduce, 2, -1), "reduce");
    EXPECT_EQ(name(static_cast<TraceKind>(99), 0), "event 99");
}

TEST(TraceWriter, RankBlobsRoundTripAndBadBlobsAreErrors) {
    const auto ranks = two_ranks();
    const Bytes blob = detail::encode_rank_trace(ranks[0]);
    const detail::RankTrace back = detail::decode_rank_trace(blob);
    EXPECT_EQ(back.rank, 0);
    EXPECT_EQ(back.host, "node-a");
    EXPECT_EQ(back.recorded, 5u);
    ASSERT_EQ(back.events.size(), ranks[0].events.size());
    for (size_t i = 0; i < back.events.size(); ++i) {
        EXPECT_EQ(std::memcmp(&back.events[i], &ranks[0].events[i], sizeof(TraceEvent)), 0) << i;
    }
    Bytes cut = blob;
    cut.resize(blob.size() - 10);
    EXPECT_THROW((void)detail::decode_rank_trace(cut), Error);
    Bytes foreign = blob;
    foreign[0] ^= 0xff;
    EXPECT_THROW((void)detail::decode_rank_trace(foreign), Error);
    EXPECT_THROW((void)detail::decode_rank_trace(Bytes{}), Error);
}

TEST(TraceWriter, RanksOnRankZerosHostKeepTheirClockOthersAreShiftedByTheHostClocks) {
    std::vector<detail::RankTrace> ranks(3);
    ranks[0].host = ranks[1].host = "node-a";
    ranks[2].host = "node-b";
    ranks[0].clock_offset_ns = 1'000;  // as gathered: CLOCK_REALTIME - %globaltimer per rank
    ranks[1].clock_offset_ns = 1'700;  // same host: its GPU shares %globaltimer whatever the measurement says
    ranks[2].clock_offset_ns = 5'000;  // node-b's timers read 4 us less than node-a's at the same wall time
    detail::align_rank_clocks(ranks);
    EXPECT_EQ(ranks[0].clock_offset_ns, 0);
    EXPECT_EQ(ranks[1].clock_offset_ns, 0);
    EXPECT_EQ(ranks[2].clock_offset_ns, 4'000);
}

// A block that keeps a trace log claims its slots at its start and writes those it leaves empty as kind 0: the host
// drops them (in order, counting them as unused), and an event of any real kind stays.
TEST(TraceWriter, EmptySlotsOfABlockLogAreDroppedAndCounted) {
    const TraceEvent empty{};
    std::vector<TraceEvent> events = {event(TraceKind::kSend, TraceRole::kComm, 1, 10, 20, -1, 1),
                                      empty,
                                      event(TraceKind::kWaitPeer, TraceRole::kComm, 1, 5, 9, 0, 120, 3),
                                      empty,
                                      empty,
                                      event(TraceKind::kNotify, TraceRole::kComm, 1, 21, 22, 0, 0)};
    EXPECT_EQ(detail::drop_empty_trace_events(events), 3u);
    ASSERT_EQ(events.size(), 3u);
    EXPECT_EQ(events[0].kind, static_cast<uint16_t>(TraceKind::kSend));
    EXPECT_EQ(events[1].kind, static_cast<uint16_t>(TraceKind::kWaitPeer));
    EXPECT_EQ(events[2].kind, static_cast<uint16_t>(TraceKind::kNotify));
    EXPECT_EQ(detail::drop_empty_trace_events(events), 0u);
    std::vector<TraceEvent> none = {empty, empty};
    EXPECT_EQ(detail::drop_empty_trace_events(none), 2u);
    EXPECT_TRUE(none.empty());
    // The JSON of what is left names no empty event.
    detail::RankTrace r;
    r.recorded = 3;
    r.events = events;
    const std::string json = detail::chrome_trace_json({r});
    EXPECT_EQ(json.find("\"kind\":0,"), std::string::npos);
}

// The low-latency kernels claim their trace slots at their start: the bound must cover every event a block defers
// (send: a credit wait per rank, "send", a "notify" per rank; receive: a wait per rank and "recv" or "combine").
TEST(TraceWriter, LowLatencyClaimCoversEveryDeferredEvent) {
    EXPECT_EQ(weft::ep::ll_trace_events_per_block(weft::ep::kPhaseSend, 1), 3);
    EXPECT_EQ(weft::ep::ll_trace_events_per_block(weft::ep::kPhaseRecv, 1), 2);
    EXPECT_EQ(weft::ep::ll_trace_events_per_block(weft::ep::kPhaseSend | weft::ep::kPhaseRecv, 1), 5);
    EXPECT_EQ(weft::ep::ll_trace_events_per_block(weft::ep::kPhaseSend | weft::ep::kPhaseRecv, 8), 26);
    EXPECT_EQ(weft::ep::ll_trace_events_per_block(0, 8), 0);
}

// Each trace site of a low-latency block writes its own slot of the block log: for every launch's phases and world
// size the sites' slots are distinct and fill [0, count()) exactly (no slot claimed that no site owns, none outside
// the claim), the spans, which every block writes, sit at the first slots (always within the log's 64), and the
// notifies, which only the last block writes, at the last.
TEST(TraceWriter, LowLatencySlotsGiveEverySiteItsOwnSlotInTheClaim) {
    using weft::ep::LlTraceSlots;
    const int32_t all_phases[] = {weft::ep::kPhaseSend, weft::ep::kPhaseRecv,
                                  weft::ep::kPhaseSend | weft::ep::kPhaseRecv};
    for (const int32_t phases : all_phases) {
        for (int32_t num_ranks = 1; num_ranks <= weft::ep::kMaxRanks; ++num_ranks) {
            SCOPED_TRACE(::testing::Message() << "phases " << phases << ", " << num_ranks << " ranks");
            const LlTraceSlots slots{phases, num_ranks};
            std::vector<int> owners(static_cast<size_t>(slots.count()), 0);
            const auto own = [&](int slot) {
                ASSERT_GE(slot, 0);
                ASSERT_LT(slot, slots.count());
                ++owners[static_cast<size_t>(slot)];
            };
            const bool send = (phases & weft::ep::kPhaseSend) != 0;
            const bool recv = (phases & weft::ep::kPhaseRecv) != 0;
            if (send) {
                own(slots.send_span());
                EXPECT_EQ(slots.send_span(), 0);
                for (int r = 0; r < num_ranks; ++r) own(slots.credit_wait(r));
                for (int r = 0; r < num_ranks; ++r) own(slots.notify(r));
            }
            if (recv) {
                own(slots.recv_span());
                EXPECT_EQ(slots.recv_span(), send ? 1 : 0);
                for (int r = 0; r < num_ranks; ++r) own(slots.recv_wait(r));
            }
            // The last block's notifies (after its signals) are the last run: past the log's 64 they go first.
            if (send) {
                EXPECT_EQ(slots.notify(0), slots.count() - num_ranks);
            }
            EXPECT_EQ(std::count(owners.begin(), owners.end(), 1), slots.count()) << "a slot with no site or two";
            EXPECT_EQ(slots.count(), weft::ep::ll_trace_events_per_block(phases, num_ranks));
        }
    }
}

TEST(TraceEnv, PathCapacityAndTheJitDefine) {
    {
        ScopedEnv unset("WEFT_TRACE", std::nullopt);
        EXPECT_FALSE(trace_path_from_env());
        const jit::CompileOptions o = jit::apply_env_options({});
        for (const auto& d : o.defines) EXPECT_EQ(d.find("WEFT_TRACE"), std::string::npos) << d;
    }
    {
        ScopedEnv set("WEFT_TRACE", std::string("out.json"));
        EXPECT_EQ(trace_path_from_env().value_or(""), "out.json");
        const jit::CompileOptions o = jit::apply_env_options({});
        EXPECT_NE(std::find(o.defines.begin(), o.defines.end(), "WEFT_TRACE=1"), o.defines.end());
    }
    {
        ScopedEnv events("WEFT_TRACE_EVENTS", std::to_string(1 << 19));
        EXPECT_EQ(trace_capacity_from_env(), 1u << 19);
    }
    {
        ScopedEnv events("WEFT_TRACE_EVENTS", std::to_string((1 << 19) + 1));
        EXPECT_THROW((void)trace_capacity_from_env(), Error);
    }
    {
        ScopedEnv events("WEFT_TRACE_EVENTS", std::string("0"));
        EXPECT_THROW((void)trace_capacity_from_env(), Error);
    }
    {
        ScopedEnv events("WEFT_TRACE_EVENTS", std::nullopt);
        EXPECT_EQ(trace_capacity_from_env(), 262144u);
    }
    EXPECT_EQ(trace_buffer_bytes(1), sizeof(TraceBuffer));
    EXPECT_EQ(trace_buffer_bytes(3), sizeof(TraceBuffer) + 2 * sizeof(TraceEvent));
}

// ---- the instrumentation costs nothing when off ----

/// `text` with every statement that names WEFT_TRACE_ (up to where its parentheses close and no backslash continues
/// it) and its include of the trace header blanked, so that every other line keeps its number (spins record theirs in
/// diagnostics): the kernel as it reads without the trace.
std::string strip_trace_lines(const std::string& text) {
    std::istringstream in(text);
    std::string line, out;
    bool blanking = false;
    int depth = 0;
    while (std::getline(in, line)) {
        if (!blanking && (line.find("WEFT_TRACE_") != std::string::npos ||
                          line.find("#include \"weft/device/trace.cuh\"") != std::string::npos)) {
            blanking = true;
            depth = 0;
        }
        if (!blanking) {
            out += line + "\n";
            continue;
        }
        depth += static_cast<int>(std::count(line.begin(), line.end(), '(')) -
                 static_cast<int>(std::count(line.begin(), line.end(), ')'));
        out += "\n";
        if (depth <= 0 && (line.empty() || line.back() != '\\')) blanking = false;
    }
    return out;
}

/// The instrumented sources (kernels and device headers), stripped, under `root` (searched before weft's own: they
/// shadow them).
void write_stripped_kernels(const fs::path& root) {
    const jit::IncludeRoots roots = jit::find_include_roots();
    const std::pair<fs::path, const char*> files[] = {
        {roots.weft_kernels, "ag_gemm/ag_gemm.cuh"},
        {roots.weft_kernels, "gemm/gemm_sm90.cuh"},
        {roots.weft_kernels, "gemm/gemm_hooks.cuh"},
        {roots.weft_kernels, "gemm_rs/gemm_rs.cuh"},
        {roots.weft_kernels, "all_reduce/all_reduce.cuh"},
        {roots.weft_kernels, "all_gather/all_gather.cuh"},
        {roots.weft_kernels, "reduce_scatter/reduce_scatter.cuh"},
        {roots.weft_kernels, "all_to_all/all_to_all.cuh"},
        {roots.weft_kernels, "ep/layout.cuh"},
        {roots.weft_kernels, "ep/normal.cuh"},
        {roots.weft_kernels, "ep/low_latency.cuh"},
        {roots.weft_include, "weft/device/block_barrier.cuh"},
        {roots.weft_include, "weft/device/tile.cuh"},
    };
    for (const auto& [base, rel] : files) {
        const std::string text = testing::read_text_file(base / rel);
        ASSERT_NE(text.find("WEFT_TRACE_"), std::string::npos) << rel << " is no longer instrumented: update this test";
        const std::string stripped = strip_trace_lines(text);
        ASSERT_EQ(stripped.find("WEFT_TRACE_"), std::string::npos) << rel;
        testing::write_text_file(root / rel, stripped);
    }
}

std::map<std::string, std::string> sass_of(const jit::CompileResult& r, std::string* why_not) {
    std::string tool;
    return testing::disassemble(*r.cubin, &tool, why_not);
}

TEST(TraceNvrtc, UntracedKernelsAreTheKernelsWithoutTheInstrumentationAndTracedOnesRecord) {
    TempDir stripped_root("weft_trace_stripped");
    write_stripped_kernels(stripped_root.path());
    jit::Compiler compiler(testing::isolated_compiler_config(fs::path()));
    jit::Compiler stripped(testing::isolated_compiler_config(fs::path(), {stripped_root.path()}));

    GemmConfig config = gemm_candidate(0, DType::kBF16, DType::kBF16, BLayout::kNK);
    config.cluster_m = config.cluster_n = 1;
    std::vector<jit::KernelSpec> specs = {ops::detail::ag_gemm_kernel_spec(config, "sm_90a"),
                                          ops::detail::ag_notify_kernel_spec("sm_90a"),
                                          ops::detail::rs_reduce_kernel_spec(DType::kF32, DType::kBF16, "sm_90a"),
                                          ops::detail::gemm_rs_kernel_spec(config, "sm_90a", ops::GemmRsMode::kPush)};
    // A collective (entry barrier, stage, reduce) and EP kernels (peer-named waits, sends, receives; the low-latency
    // ones keep their events in the block's trace log until their end).
    specs.push_back(ops::detail::collective_kernel_spec(ops::detail::KernelId::kAllReduceOneShot, DType::kBF16, 8));
    for (const jit::KernelSpec& s : ops::ep::kernel_specs()) {
        for (const char* name : {"normal_dispatch<", "low_latency_dispatch<", "low_latency_combine<"}) {
            if (s.instantiation.find(name) != std::string::npos) specs.push_back(s);
        }
    }
    ASSERT_EQ(specs.size(), 8u) << "normal_dispatch, low_latency_dispatch or low_latency_combine is missing from the "
                                   "EP kernel specs";
    for (jit::KernelSpec& s : specs) s.arch = "sm_90a";
    for (const jit::KernelSpec& spec : specs) {
        SCOPED_TRACE(spec.describe());
        const jit::CompileResult off = compiler.compile(spec);
        const jit::CompileResult without = stripped.compile(spec);
        ASSERT_NE(off.key, without.key) << "the stripped sources were not used";
        jit::KernelSpec traced_spec = spec;
        traced_spec.options.defines.push_back("WEFT_TRACE=1");
        const jit::CompileResult traced = compiler.compile(traced_spec);

        std::string why_not;
        const auto off_sass = sass_of(off, &why_not);
        if (off_sass.empty()) GTEST_SKIP() << "SKIPPED: cannot disassemble: " << why_not;
        const auto without_sass = sass_of(without, &why_not);
        const auto traced_sass = sass_of(traced, &why_not);
        ASSERT_EQ(off_sass.count(off.lowered_name), 1u) << off.lowered_name;
        ASSERT_EQ(without_sass.count(off.lowered_name), 1u);
        ASSERT_EQ(traced_sass.count(off.lowered_name), 1u);
        EXPECT_TRUE(off_sass == without_sass) << "an untraced build differs from the kernel without the trace lines";
        // Spins read %globaltimer for their bound in every build; only a traced one reads %smid (SR_VIRTUALSMID).
        EXPECT_EQ(off_sass.at(off.lowered_name).find("SMID"), std::string::npos);
        const std::string& t = traced_sass.at(off.lowered_name);
        EXPECT_NE(t.find("SMID"), std::string::npos) << "a traced build reads no %smid";
        EXPECT_NE(t, off_sass.at(off.lowered_name));
    }
}

/// The instructions of a function's SASS in address order: "[@P0 ]OPCODE operands" (the address, the trailing ';'
/// and the encoding dropped).
std::vector<std::string> sass_instructions(const std::string& sass) {
    static const std::regex line(R"(/\*[0-9a-f]{4,}\*/\s+([^;]*);)");
    std::vector<std::string> out;
    for (auto it = std::sregex_iterator(sass.begin(), sass.end(), line); it != std::sregex_iterator(); ++it) {
        out.push_back((*it)[1].str());
    }
    return out;
}

/// Whether `ins` reads register `reg` (a source operand: every operand of a store or reduction, the operands after
/// the first of any other instruction).
bool reads_register(const std::string& ins, const std::string& reg) {
    static const std::regex parts(R"(^(@!?U?P\w+\s+)?(\S+)\s*(.*)$)");
    std::smatch m;
    if (!std::regex_match(ins, m, parts)) return false;
    const std::string op = m[2].str();
    std::string operands = m[3].str();
    const bool all_sources = op.rfind("ST", 0) == 0 || op.rfind("RED", 0) == 0;
    if (!all_sources) {
        const size_t comma = operands.find(',');
        operands = comma == std::string::npos ? std::string() : operands.substr(comma + 1);
    }
    return std::regex_search(operands, std::regex("\\b" + reg + "\\b"));
}

// The low-latency kernels claim their trace slots at their start (the buffer's address a kernel parameter): in a
// traced build the claim is a returning global atomic before the kernel's first barrier, and nothing reads its result
// before the kernel's last barrier (the flush's): no thread waits for it on the way. The flush itself loads nothing
// from global memory.
TEST(TraceNvrtc, LowLatencyBlockLogClaimsAtTheStartAndOnlyTheFlushReadsTheClaim) {
    jit::Compiler compiler(testing::isolated_compiler_config(fs::path()));
    std::vector<jit::KernelSpec> specs;
    for (const jit::KernelSpec& s : ops::ep::kernel_specs()) {
        for (const char* name : {"low_latency_dispatch<", "low_latency_combine<"}) {
            if (s.instantiation.find(name) != std::string::npos) specs.push_back(s);
        }
    }
    ASSERT_EQ(specs.size(), 2u);
    for (jit::KernelSpec& spec : specs) {
        spec.arch = "sm_90a";
        spec.options.defines.push_back("WEFT_TRACE=1");
        SCOPED_TRACE(spec.describe());
        const jit::CompileResult traced = compiler.compile(spec);
        std::string why_not;
        const auto sass = sass_of(traced, &why_not);
        if (sass.empty()) GTEST_SKIP() << "SKIPPED: cannot disassemble: " << why_not;
        ASSERT_EQ(sass.count(traced.lowered_name), 1u);
        const std::vector<std::string> ins = sass_instructions(sass.at(traced.lowered_name));
        size_t first_bar = ins.size(), last_bar = ins.size();
        for (size_t i = 0; i < ins.size(); ++i) {
            if (ins[i].find("BAR.SYNC") == std::string::npos) continue;
            if (first_bar == ins.size()) first_bar = i;
            last_bar = i;
        }
        ASSERT_LT(first_bar, ins.size()) << "no barrier";
        static const std::regex atomg(R"(ATOMG?\.\S*\s+PT,\s+(R\d+),)");
        size_t claim = ins.size();
        std::string claim_reg;
        for (size_t i = 0; i < first_bar; ++i) {
            std::smatch m;
            if (std::regex_search(ins[i], m, atomg)) {
                EXPECT_EQ(claim, ins.size()) << "a second atomic before the first barrier: " << ins[i];
                claim = i;
                claim_reg = m[1].str();
            }
        }
        ASSERT_LT(claim, ins.size()) << "the traced kernel claims no trace slots before its first barrier";
        for (size_t i = claim + 1; i < last_bar; ++i) {
            EXPECT_FALSE(reads_register(ins[i], claim_reg))
                << "instruction " << i << " reads the claim's result " << claim_reg << " before the flush: " << ins[i];
        }
        size_t flush_end = last_bar;
        while (flush_end < ins.size() && ins[flush_end].rfind("EXIT", 0) != 0) ++flush_end;
        for (size_t i = last_bar; i < flush_end; ++i) {
            EXPECT_EQ(ins[i].find("LDG"), std::string::npos) << "the flush loads from global memory: " << ins[i];
        }
    }
}

}  // namespace
}  // namespace weft
