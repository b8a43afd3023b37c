// SPDX-License-Identifier: MIT
// Unit tests (CPU, NVRTC + the disassembler): the abort word costs the tight phase of a wait nothing. A wait whose
// DeviceCtx carries an abort word and the same wait without one (abort_flag a null constant, which removes the
// abort read) compile to the same per-poll loop; the one extra load, of the abort word, is reached only through
// the backoff's NANOSLEEP; and a wait that gives up ends with EXIT, not a trap. For spin_until (every signal wait)
// and ll::wait_line (the low-latency collectives).
#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "support/sass_testing.hpp"
#include "weft/jit/compiler.hpp"

namespace weft {
namespace {

constexpr const char* kKernels = R"(
using namespace weft;
using namespace weft::device;
extern "C" __global__ void spin_with_abort(DeviceCtx ctx, const uint64_t* sig, uint64_t* out) {
    out[0] = spin_until(ctx, sig, Cmp::kGe, 1, SpinSite{SpinKind::kSignalWait, -1, 0});
}
extern "C" __global__ void spin_without_abort(DeviceCtx ctx, const uint64_t* sig, uint64_t* out) {
    ctx.abort_flag = nullptr;
    out[0] = spin_until(ctx, sig, Cmp::kGe, 1, SpinSite{SpinKind::kSignalWait, -1, 0});
}
extern "C" __global__ void line_with_abort(DeviceCtx ctx, const void* line, uint2* out) {
    out[0] = ll::wait_line(ctx, line, 7u);
}
extern "C" __global__ void line_without_abort(DeviceCtx ctx, const void* line, uint2* out) {
    ctx.abort_flag = nullptr;
    out[0] = ll::wait_line(ctx, line, 7u);
}
)";

struct Insn {
    unsigned addr = 0;
    std::string op;        ///< the mnemonic with its modifiers, without a predicate
    std::string operands;
    bool branch_target = false;
};

// The function's instructions up to its first EXIT (the body; the failure path follows it).
std::vector<Insn> body_of(const std::string& sass) {
    static const std::regex line(R"(/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)\s*([^;]*);)");
    std::vector<Insn> body;
    for (auto it = std::sregex_iterator(sass.begin(), sass.end(), line); it != std::sregex_iterator(); ++it) {
        Insn insn;
        insn.addr = static_cast<unsigned>(std::stoul((*it)[1].str(), nullptr, 16));
        insn.op = (*it)[3].str();
        insn.operands = (*it)[4].str();
        body.push_back(insn);
        if (insn.op == "EXIT") break;
    }
    std::set<unsigned> targets;
    static const std::regex target(R"(0x([0-9a-f]+))");
    for (const Insn& i : body) {
        std::smatch m;
        if ((i.op == "BRA" || i.op.rfind("BRA.", 0) == 0) && std::regex_search(i.operands, m, target)) {
            targets.insert(static_cast<unsigned>(std::stoul(m[1].str(), nullptr, 16)));
        }
    }
    for (Insn& i : body) i.branch_target = targets.count(i.addr) != 0;
    return body;
}

bool is_load(const Insn& i) { return i.op.rfind("LD.", 0) == 0 || i.op.rfind("LDG.", 0) == 0; }
bool is_wide(const Insn& i) { return i.op.find(".64") != std::string::npos || i.op.find(".128") != std::string::npos; }

// The per-poll loop: from the target of the loop's backward branch to that branch, without the backoff's region
// (from the branch that skips it to that branch's target) and without register moves, which the allocator places
// as it likes. Opcodes only.
std::vector<std::string> poll_loop(const std::vector<Insn>& body, std::string* why_not) {
    size_t back = body.size();
    unsigned head = 0;
    static const std::regex target(R"(0x([0-9a-f]+))");
    for (size_t i = 0; i < body.size(); ++i) {
        std::smatch m;
        if (body[i].op == "BRA" && std::regex_search(body[i].operands, m, target)) {
            const auto t = static_cast<unsigned>(std::stoul(m[1].str(), nullptr, 16));
            if (t < body[i].addr) {
                back = i;
                head = t;
            }
        }
    }
    size_t sleep = body.size();
    for (size_t i = 0; i < body.size(); ++i) {
        if (body[i].op == "NANOSLEEP") sleep = i;
    }
    if (back == body.size() || sleep == body.size()) {
        *why_not = "no backward branch or no NANOSLEEP in the body";
        return {};
    }
    // The conditional branch before the sleep that jumps past it: the backoff region is between the two.
    size_t skip = sleep;
    unsigned region_end = 0;
    for (size_t i = sleep; i-- > 0;) {
        std::smatch m;
        if (body[i].op == "BRA" && std::regex_search(body[i].operands, m, target)) {
            skip = i;
            region_end = static_cast<unsigned>(std::stoul(m[1].str(), nullptr, 16));
            break;
        }
    }
    std::vector<std::string> ops;
    for (size_t i = 0; i <= back; ++i) {
        const Insn& insn = body[i];
        if (insn.addr < head) continue;
        if (i > skip && insn.addr < region_end) continue;
        if (insn.op == "PRMT" || insn.op == "MOV" || insn.op.rfind("IMAD.MOV", 0) == 0 || insn.op == "NOP") continue;
        ops.push_back(insn.op);
    }
    return ops;
}

std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += x + " ";
    return s;
}

class SpinSass : public ::testing::Test {
protected:
    static void SetUpTestSuite() {
        jit::Compiler compiler(testing::isolated_compiler_config(std::filesystem::path()));
        for (const char* name : {"spin_with_abort", "spin_without_abort", "line_with_abort", "line_without_abort"}) {
            jit::KernelSpec spec;
            spec.header = "weft/device.cuh";
            spec.extra_code = kKernels;
            spec.instantiation = name;
            spec.arch = "sm_90a";
            const jit::CompileResult r = compiler.compile(spec);
            std::string tool;
            auto functions = testing::disassemble(*r.cubin, &tool, &why_not_);
            if (functions.empty()) return;
            const auto fn = functions.find(name);
            if (fn == functions.end()) {
                why_not_ = std::string("no SASS for ") + name + " from " + tool;
                return;
            }
            sass_[name] = fn->second;
        }
    }
    static std::map<std::string, std::string> sass_;
    static std::string why_not_;
};
std::map<std::string, std::string> SpinSass::sass_;
std::string SpinSass::why_not_;

void expect_lean_fast_path(const std::string& with_sass, const std::string& without_sass, const char* what) {
    SCOPED_TRACE(what);
    const std::vector<Insn> with = body_of(with_sass);
    const std::vector<Insn> without = body_of(without_sass);
    ASSERT_FALSE(with.empty());
    ASSERT_FALSE(without.empty());
    // Exactly one more load: a 32-bit one (the abort word), the polls' own loads unchanged.
    std::vector<size_t> narrow_with;
    size_t wide_with = 0, wide_without = 0, narrow_without = 0;
    for (size_t i = 0; i < with.size(); ++i) {
        if (!is_load(with[i])) continue;
        if (is_wide(with[i])) {
            ++wide_with;
        } else {
            narrow_with.push_back(i);
        }
    }
    for (const Insn& i : without) {
        if (is_load(i)) ++(is_wide(i) ? wide_without : narrow_without);
    }
    EXPECT_EQ(wide_with, wide_without) << "the polls' loads changed";
    ASSERT_EQ(narrow_with.size(), narrow_without + 1) << "expected one load of the abort word";
    // The abort load is reached only through the NANOSLEEP before it: no branch lands between them.
    const size_t load = narrow_with.back();
    size_t sleep = load;
    while (sleep > 0 && with[sleep].op != "NANOSLEEP") --sleep;
    ASSERT_EQ(with[sleep].op, "NANOSLEEP") << "no sleep before the abort word's load";
    for (size_t i = sleep + 1; i <= load; ++i) {
        EXPECT_FALSE(with[i].branch_target) << "a branch lands at 0x" << std::hex << with[i].addr
                                            << ", between the sleep and the abort word's load: the load is reachable "
                                               "without sleeping";
    }
    // The per-poll loop is the same code.
    std::string why_not;
    const auto loop_with = poll_loop(with, &why_not);
    ASSERT_FALSE(loop_with.empty()) << why_not;
    const auto loop_without = poll_loop(without, &why_not);
    ASSERT_FALSE(loop_without.empty()) << why_not;
    EXPECT_EQ(join(loop_with), join(loop_without)) << "the tight poll loop changed";
    std::printf("[ SASS     ] %s: tight poll loop (both): %s\n", what, join(loop_with).c_str());
}

TEST_F(SpinSass, TheAbortWordCostsTheTightPhaseNothing) {
    if (sass_.size() < 4) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << why_not_;
    expect_lean_fast_path(sass_["spin_with_abort"], sass_["spin_without_abort"], "spin_until");
    expect_lean_fast_path(sass_["line_with_abort"], sass_["line_without_abort"], "ll::wait_line");
}

TEST_F(SpinSass, AWaitThatGivesUpExitsAndNeverTraps) {
    if (sass_.size() < 4) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << why_not_;
    for (const auto& [name, text] : sass_) {
        EXPECT_EQ(text.find("BPT.TRAP"), std::string::npos) << name << " can trap:\n" << text;
        size_t exits = 0;
        for (size_t at = text.find("EXIT"); at != std::string::npos; at = text.find("EXIT", at + 1)) ++exits;
        EXPECT_GE(exits, 2u) << name << ": the failure path does not end in EXIT";
    }
}

}  // namespace
}  // namespace weft
