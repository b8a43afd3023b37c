// SPDX-License-Identifier: MIT
// SASS checks for the kernel compilation tests: ptxas' verbose report, disassembly of a cubin per function,
// and how many 16-byte global loads a function keeps in flight together.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace weft::testing {

/// Checks ptxas' verbose report (gtest EXPECTs): no C75xx performance warning (C7508 setmaxnreg ignored,
/// C7510/C7512 wgmma serialised, ...), no other warning, and no spills (at most `max_spill_bytes` stored and loaded)
/// in any function it reports on.
void expect_clean_ptxas_report(const std::string& log, const std::string& what, int max_spill_bytes = 0);

/// SASS per function (mangled name -> text) of the cubin file `cubin`, from cuobjdump -sass or, failing that,
/// nvdisasm ($WEFT_CUOBJDUMP / $WEFT_NVDISASM, PATH, the toolkit, then the NVIDIA wheels). Empty, with the
/// reason in `why_not`, when neither tool is found or works; `tool_used` names the tool that ran.
std::map<std::string, std::string> disassemble(const std::filesystem::path& cubin, std::string* tool_used,
                                               std::string* why_not);

/// The same for a cubin in memory (written to a temporary file, removed afterwards).
std::map<std::string, std::string> disassemble(const std::vector<char>& cubin, std::string* tool_used,
                                               std::string* why_not);

/// Which loads max_loads_in_flight counts from: any, or only those whose value is first used by an
/// instruction other than a store (computed on, as in a reduction, rather than copied).
enum class LoadUse { kAny, kComputed };

/// For each 16-byte global load of a function's SASS, in program order: how many 16-byte loads are issued from
/// it (itself included) before its value is first used, i.e. how many loads are in flight together when the
/// first of them is waited for. A register is "used" when a later instruction names it outside its own
/// destination slot (the first operand of a load). With LoadUse::kComputed, only the loads that feed a
/// computation are listed (the loads counted in each run are counted whatever their use).
std::vector<int> loads_in_flight(const std::string& sass, LoadUse counted = LoadUse::kAny);

/// The largest of loads_in_flight(sass, counted) (0 when the function has no such load).
int max_loads_in_flight(const std::string& sass, LoadUse counted = LoadUse::kAny);

}  // namespace weft::testing
