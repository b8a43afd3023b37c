// SPDX-License-Identifier: MIT
// The ahead-of-time spec registry and weft-compile's spec-file parser.
#include "weft/jit/aot.hpp"

#include <mutex>
#include <sstream>

#include "weft/runtime/error.hpp"

namespace weft::jit {

namespace {

std::mutex g_registry_mutex;
std::vector<KernelSpec>& registry() {
    static std::vector<KernelSpec> specs;
    return specs;
}

std::string trim(const std::string& s) {
    const size_t b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return {};
    const size_t e = s.find_last_not_of(" \t\r\n");
    return s.substr(b, e - b + 1);
}

}  // namespace

KernelSpec jit_selftest_saxpy_spec(int items_per_thread, int redundant_passes) {
    std::ostringstream config;
    config << "{.items_per_thread = " << items_per_thread << ", .redundant_passes = " << redundant_passes << "}";
    KernelSpec spec;
    spec.header = "jit_selftest/saxpy.cuh";
    spec.instantiation = "weft::kernels::jit_selftest::saxpy<weft::kernels::jit_selftest::SaxpyConfig" + config.str() + ">";
    spec.description = "jit_selftest::saxpy " + config.str();
    return spec;
}

void register_aot_spec(KernelSpec spec) {
    WEFT_CHECK(!spec.header.empty() && !spec.instantiation.empty(),
               "register_aot_spec: the spec needs a header and an instantiation (got header '"
                   << spec.header << "', instantiation '" << spec.instantiation << "')");
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    registry().push_back(std::move(spec));
}

std::vector<KernelSpec> aot_specs() {
    // The configs the JIT's GPU tests launch, so that `weft-compile --builtin` warms exactly those.
    std::vector<KernelSpec> specs = {jit_selftest_saxpy_spec(4, 1), jit_selftest_saxpy_spec(1, 1),
                                     jit_selftest_saxpy_spec(4, 64)};
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    specs.insert(specs.end(), registry().begin(), registry().end());
    return specs;
}

std::vector<KernelSpec> parse_spec_file(const std::string& text, const std::string& file_name) {
    std::vector<KernelSpec> specs;
    std::istringstream in(text);
    std::string raw;
    std::string pending;
    int line_no = 0, start_line = 0;
    while (std::getline(in, raw)) {
        ++line_no;
        if (!raw.empty() && raw.back() == '\r') raw.pop_back();
        if (pending.empty()) start_line = line_no;
        if (!raw.empty() && raw.back() == '\\') {
            pending += raw.substr(0, raw.size() - 1);
            continue;
        }
        const std::string line = trim(pending + raw);
        pending.clear();
        if (line.empty() || line[0] == '#') continue;
        const size_t bar = line.find('|');
        WEFT_CHECK(bar != std::string::npos, file_name << ":" << start_line
                                                       << ": expected 'header|instantiation', found no '|' in '"
                                                       << line << "'");
        KernelSpec spec;
        spec.header = trim(line.substr(0, bar));
        spec.instantiation = trim(line.substr(bar + 1));
        WEFT_CHECK(!spec.header.empty() && !spec.instantiation.empty(),
                   file_name << ":" << start_line << ": both the header and the instantiation must be non-empty in '"
                             << line << "'");
        spec.description = file_name + ":" + std::to_string(start_line) + " " + spec.instantiation;
        specs.push_back(std::move(spec));
    }
    WEFT_CHECK(pending.empty(), file_name << ":" << start_line << ": the last line ends in a '\\' continuation");
    return specs;
}

}  // namespace weft::jit
