// SPDX-License-Identifier: MIT
// The JIT's on-disk kernel cache: checksummed entries written atomically, with a per-key file lock.
//
// Layout: <dir>/jit/<key>.wjit (entry) and <dir>/jit/<key>.lock (flock target, left in place).
// Entry: a fixed header {magic "WEFTJIT\0", format version, key, payload length, payload SHA-256}
// followed by the payload {lowered name, cubin, compile log}. A reader trusts an entry only when the
// magic, version, key, length and checksum all match; anything else is reported as corrupt.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "weft/jit/hash.hpp"

namespace weft::jit {

/// What the cache stores for one key.
struct CacheEntry {
    std::string lowered_name;  ///< mangled name of the kernel, for cuLibraryGetKernel
    std::vector<char> cubin;   ///< loadable image for the key's arch
    std::string log;           ///< NVRTC / nvJitLink log incl. ptxas' report
};

/// Serialises `entry` for `key` (header + payload).
std::vector<char> encode_cache_entry(const Digest& key, const CacheEntry& entry);
/// Parses bytes written by encode_cache_entry; nullopt (with the reason in `why`) when anything is
/// off: wrong magic or version, another key, a truncated or extended file, a checksum mismatch.
std::optional<CacheEntry> decode_cache_entry(const std::vector<char>& bytes, const Digest& key, std::string* why);

/// One cache folder. Thread-safe and multi-process safe; holds no state beside its path.
class DiskCache {
public:
    /// Creates <dir>/jit if needed; throws weft::Error naming the folder when it cannot.
    explicit DiskCache(std::filesystem::path dir);

    const std::filesystem::path& dir() const { return dir_; }
    std::filesystem::path entry_path(const Digest& key) const;

    enum class LoadStatus { kHit, kAbsent, kCorrupt };
    /// Reads the entry for `key`. kCorrupt leaves the file alone (delete it under the lock).
    LoadStatus load(const Digest& key, CacheEntry* out, std::string* why = nullptr) const;
    /// Writes the entry to a temporary file in the same folder, then renames it into place, so a
    /// reader sees either no entry or a whole one. Throws weft::Error when the folder is not writable.
    void store(const Digest& key, const CacheEntry& entry) const;
    /// Removes the entry for `key` (missing is fine).
    void remove(const Digest& key) const;

    /// The file whose flock serialises work on `key` across threads and processes.
    std::filesystem::path lock_path(const Digest& key) const;

private:
    std::filesystem::path dir_;
    std::filesystem::path jit_dir_;
};

/// An exclusive flock on `path` (created if missing, left in place afterwards), held until
/// destruction. It excludes other processes and other FileLocks of this process alike. The wait is
/// bounded: after `timeout` the constructor gives up and `owns()` is false.
class FileLock {
public:
    FileLock(const std::filesystem::path& path, std::chrono::milliseconds timeout);
    ~FileLock();
    FileLock(const FileLock&) = delete;
    FileLock& operator=(const FileLock&) = delete;
    bool owns() const { return fd_ >= 0; }

private:
    int fd_ = -1;
};

/// Reads a whole file; throws weft::Error naming the path when it cannot be read.
std::vector<char> read_file_bytes(const std::filesystem::path& path);
/// Writes `bytes` to a temporary file next to `path` and renames it over `path`.
void write_file_atomically(const std::filesystem::path& path, const void* data, size_t bytes);

}  // namespace weft::jit
