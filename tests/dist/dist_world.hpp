// SPDX-License-Identifier: MIT
// The one World of a weft_dist_tests process (made in main from the launcher environment), for every test file.
#pragma once

#include <string>

namespace weft {
class World;
namespace test {
/// This process's World (valid while the tests run).
World& dist_world();
/// Why a test of the network path across nodes cannot run here ("" when it can): one node, or no NCCL
/// (test_multinode_dist.cpp).
std::string why_no_network_across_nodes(const World& w);
/// Whether this process is a child that a test started (test_peers_dist.cpp): main runs it instead of the tests.
bool is_dist_child(int argc, char** argv);
/// Runs that child; its exit code.
int run_dist_child(int argc, char** argv);
}  // namespace test
}  // namespace weft
