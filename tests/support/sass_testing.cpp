// SPDX-License-Identifier: MIT
// SASS checks for the kernel compilation tests (see sass_testing.hpp).
#include "support/sass_testing.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <system_error>

#include "weft/jit/paths.hpp"

namespace weft::testing {

namespace fs = std::filesystem;

namespace {

std::string run_capture(const std::string& cmd, int* status) {
    std::string out;
    FILE* p = popen(cmd.c_str(), "r");
    if (p == nullptr) {
        *status = -1;
        return out;
    }
    std::array<char, 65536> buf{};
    size_t n = 0;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
    *status = pclose(p);
    return out;
}

bool executable(const fs::path& p) {
    std::error_code ec;
    return fs::is_regular_file(p, ec) && (fs::status(p, ec).permissions() & fs::perms::owner_exec) != fs::perms::none;
}

// Looks for a CUDA binary tool: $WEFT_<NAME>, PATH, the toolkit, then the NVIDIA wheels on PyPI
// (nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm, which CI installs).
std::optional<fs::path> find_tool(const std::string& name) {
    std::string env_name = "WEFT_" + name;
    for (auto& ch : env_name) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    if (const char* e = std::getenv(env_name.c_str()); e && executable(e)) return fs::path(e);
    if (const char* path = std::getenv("PATH")) {
        std::stringstream ss(path);
        std::string dir;
        while (std::getline(ss, dir, ':')) {
            if (!dir.empty() && executable(fs::path(dir) / name)) return fs::path(dir) / name;
        }
    }
    try {
        for (const fs::path& inc : jit::find_cuda_include_dirs()) {
            if (executable(inc / ".." / "bin" / name)) return inc / ".." / "bin" / name;
        }
    } catch (const std::exception&) {
        // no toolkit found: the wheels below may still hold the tool
    }
    int status = 0;
    const std::string sites = run_capture(
        "python3 -c \"import site; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))\" "
        "2>/dev/null",
        &status);
    std::stringstream ss(sites);
    std::string site;
    while (std::getline(ss, site)) {
        for (const char* sub :
             {"nvidia/cu13/bin", "nvidia/cuda_cuobjdump/bin", "nvidia/cuda_nvdisasm/bin", "nvidia/cu12/bin"}) {
            if (!site.empty() && executable(fs::path(site) / sub / name)) return fs::path(site) / sub / name;
        }
    }
    return std::nullopt;
}

}  // namespace

void expect_clean_ptxas_report(const std::string& log, const std::string& what, int max_spill_bytes) {
    EXPECT_EQ(log.find("C75"), std::string::npos) << what << ": ptxas performance warning:\n" << log;
    EXPECT_EQ(log.find("warning"), std::string::npos) << what << ":\n" << log;
    const std::regex spill(R"((\d+) bytes spill stores, (\d+) bytes spill loads)");
    int functions = 0;
    for (auto it = std::sregex_iterator(log.begin(), log.end(), spill); it != std::sregex_iterator(); ++it) {
        ++functions;
        EXPECT_LE(std::stoi((*it)[1].str()), max_spill_bytes) << what << ": spill stores\n" << log;
        EXPECT_LE(std::stoi((*it)[2].str()), max_spill_bytes) << what << ": spill loads\n" << log;
    }
    EXPECT_GT(functions, 0) << what << ": no ptxas report in the NVRTC log (was --ptxas-options=-v ignored?)\n" << log;
}

std::map<std::string, std::string> disassemble(const fs::path& cubin, std::string* tool_used, std::string* why_not) {
    std::map<std::string, std::string> out;
    const auto cuobjdump = find_tool("cuobjdump");
    const auto nvdisasm = find_tool("nvdisasm");
    std::string text;
    std::string marker;
    int status = 0;
    if (cuobjdump) {
        // cuobjdump -sass runs nvdisasm: put it on PATH when it came from a wheel.
        std::string cmd;
        if (nvdisasm) cmd = "PATH=\"" + nvdisasm->parent_path().string() + ":$PATH\" ";
        cmd += "\"" + cuobjdump->string() + "\" -sass \"" + cubin.string() + "\" 2>&1";
        text = run_capture(cmd, &status);
        marker = "Function : ";
        *tool_used = cuobjdump->string();
        if (status != 0 || text.find(marker) == std::string::npos) text.clear();
    }
    if (text.empty() && nvdisasm) {
        text = run_capture("\"" + nvdisasm->string() + "\" \"" + cubin.string() + "\" 2>&1", &status);
        marker = ".section\t.text.";
        *tool_used = nvdisasm->string();
        if (status != 0) text.clear();
    }
    if (text.empty()) {
        *why_not = !cuobjdump && !nvdisasm
                       ? "neither cuobjdump nor nvdisasm was found (python3 -m pip install nvidia-cuda-cuobjdump "
                         "nvidia-cuda-nvdisasm, or set WEFT_CUOBJDUMP / WEFT_NVDISASM)"
                       : "cuobjdump/nvdisasm ran but produced no SASS (cuobjdump -sass needs nvdisasm: python3 -m "
                         "pip install nvidia-cuda-nvdisasm)";
        return out;
    }
    size_t pos = text.find(marker);
    while (pos != std::string::npos) {
        const size_t name_begin = pos + marker.size();
        const size_t name_end = text.find_first_of(",\n \t", name_begin);
        const size_t next = text.find(marker, name_begin);
        out[text.substr(name_begin, name_end - name_begin)] =
            text.substr(name_begin, (next == std::string::npos ? text.size() : next) - name_begin);
        pos = next;
    }
    return out;
}

std::map<std::string, std::string> disassemble(const std::vector<char>& cubin, std::string* tool_used,
                                               std::string* why_not) {
    const fs::path file =
        fs::temp_directory_path() /
        ("weft_sass_" + std::to_string(::getpid()) + "_" + std::to_string(std::random_device{}()) + ".cubin");
    {
        std::ofstream f(file, std::ios::binary);
        f.write(cubin.data(), static_cast<std::streamsize>(cubin.size()));
        if (!f.good()) {
            *why_not = "cannot write " + file.string();
            return {};
        }
    }
    auto out = disassemble(file, tool_used, why_not);
    std::error_code ec;
    fs::remove(file, ec);
    return out;
}

std::vector<int> loads_in_flight(const std::string& sass, LoadUse counted) {
    std::vector<std::string> lines;
    std::stringstream in(sass);
    for (std::string line; std::getline(in, line);) {
        if (line.find("/*") != std::string::npos && line.find(';') != std::string::npos) lines.push_back(line);
    }
    const std::regex load(R"(LDG?\.E\.128\S*\s+(R\d+),)");
    const std::regex store(R"(\*/\s+(@!?U?P\w+\s+)?ST\w*\.)");  // ST, STG, STS, STL ... (optionally predicated)
    std::vector<int> out;
    for (size_t i = 0; i < lines.size(); ++i) {
        std::smatch m;
        if (!std::regex_search(lines[i], m, load)) continue;
        const std::regex use("\\b" + m[1].str() + "\\b");
        int in_flight = 1;
        bool stored = false;
        for (size_t j = i + 1; j < lines.size(); ++j) {
            std::smatch mj;
            const bool is_load = std::regex_search(lines[j], mj, load);
            const std::string rest =
                is_load ? lines[j].substr(static_cast<size_t>(mj.position(0) + mj.length(0))) : lines[j];
            if (std::regex_search(rest, use)) {
                stored = std::regex_search(lines[j], store);
                break;
            }
            in_flight += is_load;
        }
        if (counted == LoadUse::kComputed && stored) continue;
        out.push_back(in_flight);
    }
    return out;
}

int max_loads_in_flight(const std::string& sass, LoadUse counted) {
    const std::vector<int> runs = loads_in_flight(sass, counted);
    return runs.empty() ? 0 : *std::max_element(runs.begin(), runs.end());
}

}  // namespace weft::testing
