// SPDX-License-Identifier: MIT
// weft-install-prefix: writes an install prefix into an installed weft library (run by `cmake --install`).
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "weft/detail/install_prefix.hpp"
#include "weft/jit/cache.hpp"
#include "weft/runtime/error.hpp"

namespace {

constexpr const char* kUsage = R"(usage: weft-install-prefix LIBRARY PREFIX
Writes PREFIX into the install prefix slot of LIBRARY (libweft.a or libweft.so), the last place weft's JIT
looks for PREFIX/include and PREFIX/share/weft/kernels. `cmake --install` runs it on the library it
installs; nothing else needs to.
)";

}  // namespace

int main(int argc, char** argv) {
    const bool help = argc == 2 && std::strcmp(argv[1], "--help") == 0;
    if (argc != 3) {
        std::fputs(kUsage, help ? stdout : stderr);
        return help ? 0 : 2;
    }
    try {
        namespace fs = std::filesystem;
        const fs::path library = argv[1];
        // Normal form without a trailing '/', so that the JIT's messages show the prefix plainly.
        std::string prefix = fs::absolute(argv[2]).lexically_normal().string();
        if (prefix.size() > 1 && prefix.back() == '/') prefix.pop_back();
        struct stat st {};
        WEFT_CHECK(::stat(library.c_str(), &st) == 0,
                   "cannot stat '" << library.string() << "': " << std::strerror(errno));
        std::vector<char> image = weft::jit::read_file_bytes(library);
        weft::detail::rewrite_install_prefix_slot(image, prefix);
        // A new file renamed over the old one: a process that has the old library mapped keeps its copy.
        weft::jit::write_file_atomically(library, image.data(), image.size());
        WEFT_CHECK(::chmod(library.c_str(), st.st_mode & 07777) == 0,
                   "cannot restore the mode of '" << library.string() << "': " << std::strerror(errno));
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "weft-install-prefix: %s\n", e.what());
        return 1;
    }
}
