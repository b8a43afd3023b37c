// SPDX-License-Identifier: MIT
// The JIT's on-disk kernel cache: checksummed entries written atomically, with a per-key file lock.
//
// Layout: <dir>/jit/<key>.wjit (entry) and <dir>/jit/<key>.lock (flock target, left in place).
// Entry: a fixed header {magic "WEFTJIT\0", format version, key, payload length, payload SHA-256}
// followed by the payload {lowered name, cubin, compile log}. A reader trusts an entry only when the
// magic, version, key, length and checksum all match; anything else is reported as corrupt.
// The checksum has no key: anyone who can write an entry can make one that verifies. So the cache trusts
// only what this user could have written (docs/jit.md, "Trust"): <dir> and <dir>/jit must be folders owned
// by this user (or root) that group and others cannot write (unless sticky), and an entry or lock file a
// regular file of this user (or root) that they cannot write, opened without following a symbolic link and
// without blocking, and an entry at most kMaxEntryBytes long. Anything else is a miss, logged with the
// reason; nothing is stored in an untrusted folder.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weft/jit/hash.hpp"

namespace weft::jit {

/// The largest entry a reader accepts; a larger file (a sparse one, say) is a miss, not read.
inline constexpr uint64_t kMaxEntryBytes = 256ull << 20;

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

/// One cache folder. Thread-safe and multi-process safe; holds no state beside its path and whether it has reported
/// the folder untrusted (shared by its copies).
class DiskCache {
public:
    /// Creates <dir>/jit if needed (folders it creates are mode 0755, whatever the umask); throws
    /// weft::Error naming the folder when it cannot. An existing folder that is not trusted is a warning:
    /// every load is then a miss and every store an error. In a trusted one, temporaries of stores that were
    /// killed before their rename (untouched for an hour) are removed.
    explicit DiskCache(std::filesystem::path dir);

    const std::filesystem::path& dir() const { return dir_; }
    std::filesystem::path entry_path(const Digest& key) const;

    enum class LoadStatus { kHit, kAbsent, kCorrupt };
    /// Reads the entry for `key`. Never blocks (a FIFO is refused at open). An untrusted folder or entry
    /// is kAbsent, a miss, with the reason in `why` and a warning (an untrusted folder: once per cache). kCorrupt (a
    /// trusted file that does not decode) leaves the file alone (delete it under the lock).
    LoadStatus load(const Digest& key, CacheEntry* out, std::string* why = nullptr) const;
    /// Writes the entry to a temporary file in the same folder, then renames it into place, so a
    /// reader sees either no entry or a whole one. Throws weft::Error when the folder is not writable
    /// or not trusted.
    void store(const Digest& key, const CacheEntry& entry) const;
    /// Removes the entry for `key` (missing is fine; nothing is removed from an untrusted folder).
    void remove(const Digest& key) const;

    /// What prune() did.
    struct PruneResult {
        uint64_t removed = 0;        ///< entries removed
        uint64_t removed_bytes = 0;  ///< their bytes
        uint64_t kept = 0;           ///< entries kept
        uint64_t removed_locks = 0;  ///< lock files removed (their entry gone, older than the cutoff, held by no one)
    };
    /// Removes the entries not used for `unused_for` (an entry's modification time is when it was last stored or
    /// loaded), so that a long-lived cache folder does not grow with every weft version and option set. Safe beside
    /// running programs: a reader keeps an entry it has open, and a removed entry is compiled again when next needed.
    /// Also removes the lock files of keys without an entry that are older than the cutoff and held by no one.
    /// Throws weft::Error naming the folder when it is untrusted.
    PruneResult prune(std::chrono::hours unused_for) const;

    /// The file whose flock serialises work on `key` across threads and processes.
    std::filesystem::path lock_path(const Digest& key) const;

private:
    /// <dir>/jit opened for *at() calls after checking <dir> and <dir>/jit; -1 with `*why` when untrusted.
    int open_jit_dir(std::string* why) const;
    void remove_abandoned_temporaries() const;

    std::filesystem::path dir_;
    std::filesystem::path jit_dir_;
    /// An untrusted folder was reported (once per cache and its copies: later loads log it at debug level).
    std::shared_ptr<std::atomic<bool>> folder_reported_ = std::make_shared<std::atomic<bool>>(false);
};

/// An exclusive flock on `path` (created if missing, left in place afterwards), held until
/// destruction. It excludes other processes and other FileLocks of this process alike. The wait is
/// bounded: after `timeout` the constructor gives up and `owns()` is false. A lock file is trusted like a
/// cache entry (see above): in an untrusted folder, through a symbolic link, or anything but a regular file of
/// this user (or root) that others cannot write, it is not taken: `owns()` is false at once, with a warning.
class FileLock {
public:
    FileLock(const std::filesystem::path& path, std::chrono::milliseconds timeout);
    ~FileLock();
    FileLock(const FileLock&) = delete;
    FileLock& operator=(const FileLock&) = delete;
    bool owns() const { return fd_ >= 0; }
    /// Not owned because another holder kept it past the timeout (not because the lock was refused at once: an
    /// untrusted or unwritable folder or file, warned about when it happens).
    bool timed_out() const { return timed_out_; }

private:
    int fd_ = -1;
    bool timed_out_ = false;
};

/// Reads a whole regular file (opened without blocking, so a FIFO is an error, not a hang); throws
/// weft::Error naming the path when it cannot be read.
std::vector<char> read_file_bytes(const std::filesystem::path& path);
/// Reads `dir`/`name` only when it is trusted as a cache entry is (a trusted `dir`; `name` a regular file, not
/// a symbolic link, owned by this user or root, not writable by others, at most `max_bytes` long); never
/// blocks. nullopt when it is absent (`*why` empty) or refused or unreadable (`*why` says why).
std::optional<std::vector<char>> read_trusted_file(const std::filesystem::path& dir, const std::string& name,
                                                   uint64_t max_bytes, std::string* why);
/// Creates `dir` (and its parents) where missing; each folder made here is mode 0755, whatever the umask (the cache
/// and its locks trust nothing others may write). `ec` as std::filesystem::create_directories sets it.
void create_cache_folder(const std::filesystem::path& dir, std::error_code& ec);
/// Writes `bytes` to a new temporary file next to `path` (mode 0644) and renames it over `path`.
void write_file_atomically(const std::filesystem::path& path, const void* data, size_t bytes);

}  // namespace weft::jit
