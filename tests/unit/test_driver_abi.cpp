// SPDX-License-Identifier: MIT
// The driver table asks for each symbol at an ABI whose signature matches the declaration it is called through.
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "weft/runtime/driver.hpp"

namespace weft::detail {
namespace {

std::string read_header(const std::string& file) {
    std::string dirs = WEFT_CUDA_INCLUDE_DIRS;
    std::stringstream list(dirs);
    for (std::string dir; std::getline(list, dir, '|');) {
        std::ifstream in(dir + "/" + file);
        if (!in) continue;
        std::ostringstream text;
        text << in.rdbuf();
        return text.str();
    }
    return "";
}

int count_params(const std::string& params) {
    if (params.find_first_not_of(" \t\n") == std::string::npos || params == "void") return 0;
    int n = 1;
    for (char c : params) n += c == ',';
    return n;
}

// cudaGetDriverEntryPointByVersion returns, for a name and a version, the newest ABI of the symbol at that
// version: the PFN_<name>_v<N> typedef with the largest N <= version. Its parameter count must be the one of the
// plain declaration in cuda.h, through which weft::driver() calls it (cuCtxGetDevice at 13000 is not).
TEST(RuntimeDriverAbi, EveryTableEntryIsAskedForAtTheAbiOfItsDeclaration) {
    const std::string typedefs = read_header("cudaTypedefs.h");
    const std::string cuda = read_header("cuda.h");
    ASSERT_FALSE(typedefs.empty()) << "cudaTypedefs.h not found in " << WEFT_CUDA_INCLUDE_DIRS;
    ASSERT_FALSE(cuda.empty()) << "cuda.h not found in " << WEFT_CUDA_INCLUDE_DIRS;
    for (std::string_view view : driver_function_names()) {
        const std::string name(view);
        const std::regex pfn("PFN_" + name + "_v(\\d+)\\)\\(([^;]*)\\);");
        int best = -1, best_params = -1;
        for (auto it = std::sregex_iterator(typedefs.begin(), typedefs.end(), pfn); it != std::sregex_iterator();
             ++it) {
            const int version = std::stoi((*it)[1].str());
            if (version <= driver_abi_version(name) && version > best) {
                best = version;
                best_params = count_params((*it)[2].str());
            }
        }
        ASSERT_GE(best, 0) << name << ": no PFN typedef at or below version " << driver_abi_version(name);
        std::smatch decl;
        const std::regex declaration("CUresult CUDAAPI " + name + "\\(([^;]*)\\);");
        ASSERT_TRUE(std::regex_search(cuda, decl, declaration)) << name << ": no declaration in cuda.h";
        EXPECT_EQ(best_params, count_params(decl[1].str()))
            << name << " is asked for at version " << driver_abi_version(name) << ", whose ABI (PFN v" << best
            << ") takes " << best_params << " parameters, but cuda.h declares " << count_params(decl[1].str());
    }
}

TEST(RuntimeDriverAbi, ContextQueriesUseTheirPre13Abi) {
    EXPECT_LT(driver_abi_version("cuCtxGetDevice"), 13000);
    EXPECT_LT(driver_abi_version("cuCtxSynchronize"), 13000);
}

}  // namespace
}  // namespace weft::detail
