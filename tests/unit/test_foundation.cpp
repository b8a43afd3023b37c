// SPDX-License-Identifier: MIT
// Unit tests for the foundation: errors, environment parsing, dtypes, tensor views.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "weft/common/dtype.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/in_process_store.hpp"
#include "weft/runtime/tensor_view.hpp"
#include "weft/runtime/world.hpp"

namespace weft {
namespace {

TEST(Error, CheckThrowsWithMessageAndLocation) {
    int n = -3;
    try {
        WEFT_CHECK(n > 0, "num_ranks must be positive, got " << n);
        FAIL() << "WEFT_CHECK did not throw";
    } catch (const Error& e) {
        std::string what = e.what();
        EXPECT_NE(what.find("num_ranks must be positive, got -3"), std::string::npos) << what;
        EXPECT_NE(what.find("test_foundation.cpp:"), std::string::npos) << what;
    }
}

TEST(Error, CheckPassesSilently) { EXPECT_NO_THROW(WEFT_CHECK(1 + 1 == 2, "arithmetic")); }

TEST(Error, CudaCheckNamesTheCallAndStatus) {
    try {
        WEFT_CUDA_CHECK(cudaErrorInvalidValue);
        FAIL() << "WEFT_CUDA_CHECK did not throw";
    } catch (const Error& e) {
        std::string what = e.what();
        EXPECT_NE(what.find("cudaErrorInvalidValue"), std::string::npos) << what;
    }
}

TEST(Env, ParseInt) {
    EXPECT_EQ(env::parse_int("42", "X"), 42);
    EXPECT_EQ(env::parse_int("-7", "X"), -7);
    EXPECT_THROW(env::parse_int("", "X"), Error);
    EXPECT_THROW(env::parse_int("4x", "X"), Error);
    EXPECT_THROW(env::parse_int(" 4", "X"), Error);
    EXPECT_THROW(env::parse_int("99999999999999999999999", "X"), Error);
}

TEST(Env, ParseBytes) {
    EXPECT_EQ(env::parse_bytes("4096", "X"), 4096u);
    EXPECT_EQ(env::parse_bytes("2K", "X"), 2048u);
    EXPECT_EQ(env::parse_bytes("512m", "X"), 512ull << 20);
    EXPECT_EQ(env::parse_bytes("3G", "X"), 3ull << 30);
    EXPECT_THROW(env::parse_bytes("G", "X"), Error);
    EXPECT_THROW(env::parse_bytes("-1", "X"), Error);
    EXPECT_THROW(env::parse_bytes("1.5G", "X"), Error);
    EXPECT_THROW(env::parse_bytes("99999999999T", "X"), Error);
}

TEST(Env, ParseBoolAndNamesTheVariable) {
    EXPECT_TRUE(env::parse_bool("On", "X"));
    EXPECT_FALSE(env::parse_bool("0", "X"));
    try {
        env::parse_bool("maybe", "WEFT_SOMETHING");
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("WEFT_SOMETHING"), std::string::npos);
    }
}

TEST(Env, GetReadsTheEnvironment) {
    ::setenv("WEFT_TEST_ENV_INT", "123", 1);
    EXPECT_EQ(env::get_int("WEFT_TEST_ENV_INT"), 123);
    ::unsetenv("WEFT_TEST_ENV_INT");
    EXPECT_FALSE(env::get_int("WEFT_TEST_ENV_INT").has_value());
}

TEST(DType, SizesAndNames) {
    EXPECT_EQ(dtype_bytes(DType::kBF16), 2);
    EXPECT_EQ(dtype_bytes(DType::kF32), 4);
    EXPECT_EQ(dtype_bytes(DType::kF8E4M3), 1);
    EXPECT_STREQ(dtype_name(DType::kF16), "f16");
    static_assert(dtype_bytes(DType::kI64) == 8);
}

TEST(TensorView, ContiguousStridesAndDescription) {
    TensorView v(reinterpret_cast<void*>(0x1000), DType::kBF16, {8, 16, 4});
    EXPECT_EQ(v.ndim, 3);
    EXPECT_EQ(v.numel(), 8 * 16 * 4);
    EXPECT_EQ(v.size_bytes(), 8 * 16 * 4 * 2);
    EXPECT_EQ(v.stride(0), 64);
    EXPECT_EQ(v.stride(1), 4);
    EXPECT_EQ(v.stride(2), 1);
    EXPECT_TRUE(v.is_contiguous());
    EXPECT_EQ(v.describe(), "bf16[8, 16, 4] strides [64, 4, 1]");
}

TEST(TensorView, StridedIsNotContiguous) {
    TensorView v(nullptr, DType::kF16, {4, 8}, {16, 1});
    EXPECT_FALSE(v.is_contiguous());
    EXPECT_THROW(TensorView(nullptr, DType::kF16, {4, 8}, {1}), Error);
    EXPECT_THROW(TensorView(nullptr, DType::kF16, {1, 2, 3, 4, 5}), Error);
    EXPECT_THROW(TensorView(nullptr, DType::kF16, {4, -1}), Error);
}

// The fields are public: a view set up by hand with a bad ndim or huge extents gets weft::Error from numel() and
// size_bytes(), never an out-of-bounds read or a wrapped count; describe() and is_contiguous() stay safe.
TEST(TensorView, HandMadeViewsWithBadFieldsAreErrorsNotOutOfBoundsReads) {
    TensorView v(reinterpret_cast<void*>(0x1000), DType::kBF16, {8, 16});
    for (int32_t bad : {-1, 5, 1000}) {
        v.ndim = bad;
        try {
            (void)v.numel();
            ADD_FAILURE() << "numel() of ndim " << bad << " did not throw";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("0 to 4 dimensions"), std::string::npos) << e.what();
        }
        EXPECT_THROW((void)v.size_bytes(), Error);
        EXPECT_FALSE(v.is_contiguous());
        EXPECT_NE(v.describe().find("ndim = " + std::to_string(bad)), std::string::npos) << v.describe();
    }
    TensorView huge(reinterpret_cast<void*>(0x1000), DType::kF32, {1, 1});
    huge.shape = {int64_t{1} << 40, int64_t{1} << 40, 1, 1};
    try {
        (void)huge.numel();
        ADD_FAILURE() << "numel() of 2^80 elements did not throw";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("overflows int64"), std::string::npos) << e.what();
    }
    huge.shape = {int64_t{1} << 31, int64_t{1} << 31, 1, 1};  // 2^62 elements fit; 2^64 bytes do not
    EXPECT_EQ(huge.numel(), int64_t{1} << 62);
    EXPECT_THROW((void)huge.size_bytes(), Error);
    huge.ndim = 4;
    huge.shape = {int64_t{1} << 40, int64_t{1} << 40, 0, 1};  // a zero extent: no element, no overflow
    EXPECT_EQ(huge.numel(), 0);
    EXPECT_THROW(TensorView(nullptr, DType::kF16, {int64_t{1} << 40, int64_t{1} << 40}), Error);
    EXPECT_EQ(TensorView(nullptr, DType::kF16, {int64_t{1} << 40, int64_t{1} << 40, 0}).numel(), 0);
}

static_assert(noexcept(cuda_available()), "cuda_available() is the query that never throws");

// driver() either resolves every entry of the table or throws an Error that names the driver; a usable device
// implies a resolved table. (CPU machines: no driver, so the error; GPU machines: the full table.)
TEST(Driver, TableIsCompleteOrTheErrorSaysWhy) {
    const bool available = cuda_available();
    bool resolved = false;
    try {
        const DriverApi& api = driver();
        resolved = true;
#define WEFT_TEST_DRIVER_ENTRY(fn) EXPECT_NE(api.fn, nullptr) << #fn " was not resolved";
        WEFT_DRIVER_FUNCTIONS(WEFT_TEST_DRIVER_ENTRY)
#undef WEFT_TEST_DRIVER_ENTRY
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("driver"), std::string::npos) << e.what();
    }
    if (available) {
        EXPECT_TRUE(resolved) << "a device is visible, yet driver() threw";
    }
    // The answer is stable: a second query agrees with the first.
    EXPECT_EQ(cuda_available(), available);
}

// Without a CUDA driver a World's start says so, not the runtime's "driver version is insufficient". (CPU machines;
// skipped where a driver is installed.) In a child process: a World's start sets CUDA's environment variables, which
// RuntimeModuleLoading expects no earlier test of the process to have set.
TEST(Driver, AWorldWithoutADriverSaysThereIsNone) {
    int driver_version = 0;
    cudaDriverGetVersion(&driver_version);
    if (driver_version != 0) GTEST_SKIP() << "a CUDA driver is installed here";
    EXPECT_EXIT(
        {
            std::string what;
            try {
                run_local(1, [](World&) {});
            } catch (const Error& e) {
                what = e.what();
            }
            std::fprintf(stderr, "%s\n", what.c_str());
            std::exit(what.find("insufficient") == std::string::npos ? 0 : 1);
        },
        ::testing::ExitedWithCode(0), "no CUDA driver on this machine \\(rank 0\\): a World needs a GPU");
}

// Ranks that refuse before the start-up exchange still take part in it (so that a refusing rank's peers fail at
// once naming it): where every rank refuses (no driver here), each ends with its own error, promptly.
TEST(Driver, RanksThatAllRefuseStillMeetAndEachThrowsItsOwnError) {
    int driver_version = 0;
    cudaDriverGetVersion(&driver_version);
    if (driver_version != 0) GTEST_SKIP() << "a CUDA driver is installed here";
    EXPECT_EXIT(
        {
            auto store = make_in_process_store();
            std::vector<std::string> errors(3);
            std::vector<std::thread> ranks;
            for (int r = 0; r < 3; ++r) {
                ranks.emplace_back([&, r] {
                    WorldMembership m;
                    m.rank = r;
                    m.num_ranks = 3;
                    try {
                        World::from_store(store, m);
                    } catch (const Error& e) {
                        errors[static_cast<size_t>(r)] = e.what();
                    }
                });
            }
            for (auto& t : ranks) t.join();
            bool own = true;
            for (int r = 0; r < 3; ++r) {
                std::fprintf(stderr, "%s\n", errors[static_cast<size_t>(r)].c_str());
                own = own && errors[static_cast<size_t>(r)].find("no CUDA driver on this machine (rank " +
                                                                 std::to_string(r) + ")") != std::string::npos;
            }
            std::exit(own ? 0 : 1);
        },
        ::testing::ExitedWithCode(0), "rank 2");
}

}  // namespace
}  // namespace weft
