// SPDX-License-Identifier: MIT
// GoogleTest entry point shared by weft's test binaries.
#include <gtest/gtest.h>

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
