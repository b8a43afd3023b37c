// SPDX-License-Identifier: MIT
// weftrun's command line: its options and their parsing (tools/weftrun/weftrun.cpp runs the job).
#pragma once

#include <string>
#include <vector>

namespace weft::weftrun {

struct Options {
    int num_ranks = 0;
    std::vector<std::string> gpus;
    double timeout_s = 0;
    int port = 0;
    double grace_s = 5;
    std::vector<std::string> command;
};

/// The options of `weftrun [options] [--] prog args...`; prints the usage and exits (2) on a usage error, prints the
/// help and exits (0) on -h / --help.
Options parse_args(int argc, char** argv);

}  // namespace weft::weftrun
