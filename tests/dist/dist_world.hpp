// SPDX-License-Identifier: MIT
// The one World of a weft_dist_tests process (made in main from the launcher environment), for every test file.
#pragma once

namespace weft {
class World;
namespace test {
/// This process's World (valid while the tests run).
World& dist_world();
}  // namespace test
}  // namespace weft
