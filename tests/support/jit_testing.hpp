// SPDX-License-Identifier: MIT
// Helpers for the JIT tests: temporary folders, scoped environment variables, a Compiler on a temp cache.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <barrier>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>

#include "weft/jit/autotune.hpp"
#include "weft/jit/compiler.hpp"

namespace weft::testing {

/// A fresh folder under the system temp dir, removed with its content on destruction.
class TempDir {
public:
    explicit TempDir(const std::string& tag = "weft_test") {
        std::random_device rd;
        for (int attempt = 0; attempt < 100; ++attempt) {
            path_ = std::filesystem::temp_directory_path() /
                    (tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
            if (std::filesystem::create_directory(path_)) return;
        }
        throw std::runtime_error("cannot create a temporary folder");
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path_, ec);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    const std::filesystem::path& path() const { return path_; }
    std::filesystem::path operator/(const std::string& rel) const { return path_ / rel; }

private:
    std::filesystem::path path_;
};

/// Sets (or unsets, with nullopt) an environment variable for the scope; restores it afterwards.
class ScopedEnv {
public:
    ScopedEnv(const char* name, const std::optional<std::string>& value) : name_(name) {
        if (const char* old = std::getenv(name)) old_ = old;
        if (value) {
            ::setenv(name, value->c_str(), 1);
        } else {
            ::unsetenv(name);
        }
    }
    ~ScopedEnv() {
        if (old_) {
            ::setenv(name_.c_str(), old_->c_str(), 1);
        } else {
            ::unsetenv(name_.c_str());
        }
    }
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

private:
    std::string name_;
    std::optional<std::string> old_;
};

inline void write_text_file(const std::filesystem::path& path, const std::string& text) {
    std::filesystem::create_directories(path.parent_path());
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.good()) throw std::runtime_error("cannot write " + path.string());
}

inline std::string read_text_file(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream os;
    os << in.rdbuf();
    return os.str();
}

/// A Compiler with weft's discovered roots, a cache in `cache_dir` (none when empty) and the
/// WEFT_JIT_* variables ignored, so that the test does not depend on the caller's environment.
inline jit::CompilerConfig isolated_compiler_config(const std::filesystem::path& cache_dir,
                                                    std::vector<std::filesystem::path> extra_roots = {}) {
    jit::CompilerConfig config;
    if (!cache_dir.empty()) config.cache_dir = cache_dir;
    config.extra_include_roots = std::move(extra_roots);
    config.apply_env_options = false;
    return config;
}

/// Ranks as threads for autotuner tests: a barrier and an all-gather over shared memory.
class ThreadTuneComm {
public:
    explicit ThreadTuneComm(int num_ranks) : num_ranks_(num_ranks), barrier_(num_ranks), values_(static_cast<size_t>(num_ranks)) {}
    /// The TuneComm rank `rank`'s thread passes to the autotuner.
    std::unique_ptr<jit::TuneComm> for_rank(int rank) {
        return std::make_unique<jit::FunctionTuneComm>(
            rank, num_ranks_, [this] { barrier_.arrive_and_wait(); },
            [this, rank](double v) {
                values_[static_cast<size_t>(rank)] = v;
                barrier_.arrive_and_wait();
                std::vector<double> all = values_;
                barrier_.arrive_and_wait();  // nobody overwrites a value before everyone has read it
                return all;
            });
    }

private:
    int num_ranks_;
    std::barrier<> barrier_;
    std::vector<double> values_;
};

}  // namespace weft::testing
