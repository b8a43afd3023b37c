// SPDX-License-Identifier: MIT
// The one World of a weft_dist_tests process (made in main from the launcher environment), for every test file.
#pragma once

namespace weft {
class World;
namespace test {
/// This process's World (valid while the tests run).
World& dist_world();
/// Whether this process is a child that a test started (test_peers_dist.cpp): main runs it instead of the tests.
bool is_dist_child(int argc, char** argv);
/// Runs that child; its exit code.
int run_dist_child(int argc, char** argv);
}  // namespace test
}  // namespace weft
