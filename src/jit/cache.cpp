// SPDX-License-Identifier: MIT
// The on-disk kernel cache: entry encoding, trusted reads, atomic writes, per-key file locks.
#include "weft/jit/cache.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"

namespace weft::jit {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'W', 'E', 'F', 'T', 'J', 'I', 'T', '\0'};
constexpr uint32_t kFormatVersion = 1;
// magic, version, header size, key, payload length, payload digest
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 32 + 8 + 32;

// Little-endian writers into a presized buffer (the format is fixed-endian, whatever the host).
char* put_uint(char* out, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
    return out + bytes;
}
uint64_t get_uint(const char* p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
    return v;
}
char* put_bytes(char* out, const void* data, size_t bytes) {
    if (bytes > 0) std::memcpy(out, data, bytes);
    return out + bytes;
}

std::string errno_text() { return std::strerror(errno); }

/// Owns a file descriptor.
class Fd {
public:
    explicit Fd(int fd = -1) : fd_(fd) {}
    ~Fd() {
        if (fd_ >= 0) ::close(fd_);
    }
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    int get() const { return fd_; }
    int release() {
        const int fd = fd_;
        fd_ = -1;
        return fd;
    }

private:
    int fd_;
};

std::string octal_mode(mode_t mode) {
    char text[8];
    std::snprintf(text, sizeof(text), "%04o", static_cast<unsigned>(mode & 07777));
    return text;
}

const char* kind_of(mode_t mode) {
    if (S_ISREG(mode)) return "a regular file";
    if (S_ISDIR(mode)) return "a folder";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISLNK(mode)) return "a symbolic link";
    if (S_ISSOCK(mode)) return "a socket";
    if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
    return "not a regular file";
}

/// Empty when the object `st` describes may be trusted as a cache folder (`directory`) or file; otherwise
/// why not. Trusted: owned by this user or by root (who could change weft itself), and not writable by
/// group or others (a folder may be, with the sticky bit: others can add files there but not replace ours).
std::string distrust(const struct stat& st, bool directory) {
    const uid_t me = ::geteuid();
    if (directory ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode)) {
        return std::string("is ") + kind_of(st.st_mode) + ", not " + (directory ? "a folder" : "a regular file");
    }
    if (st.st_uid != me && st.st_uid != 0) {
        return "is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " + std::to_string(me) +
               ") or root";
    }
    const bool others_write = (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
    if (others_write && (!directory || (st.st_mode & S_ISVTX) == 0)) {
        return "is writable by group or others (mode " + octal_mode(st.st_mode) + ")" +
               (directory ? " without the sticky bit" : "");
    }
    return {};
}

/// Opens the folder `path` for *at() calls, requiring it to be trustworthy. The last component may be a
/// symbolic link (a user's WEFT_CACHE_DIR may be one) unless `no_follow`. -1 with `*why` set on failure;
/// `*absent` tells a folder that does not exist from one that is refused.
int open_trusted_dir(int at, const char* path, bool no_follow, std::string* why, bool* absent) {
    *absent = false;
    Fd fd(::openat(at, path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | (no_follow ? O_NOFOLLOW : 0)));
    if (fd.get() < 0) {
        *absent = errno == ENOENT;
        *why = errno == ELOOP || errno == ENOTDIR ? "is a symbolic link or not a folder" : errno_text();
        return -1;
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
        *why = "cannot be examined: " + errno_text();
        return -1;
    }
    *why = distrust(st, true);
    return why->empty() ? fd.release() : -1;
}

/// Writes `bytes` to a fresh temporary file in the folder `dir_fd` and renames it to `name` there.
void write_atomically_at(int dir_fd, const std::string& name, const std::string& shown, const void* data,
                         size_t bytes) {
    std::random_device random;
    std::string tmp;
    int fd = -1;
    for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
        tmp = "." + name + ".tmp." + std::to_string(random()) + std::to_string(::getpid());
        fd = ::openat(dir_fd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (fd < 0 && errno != EEXIST) break;
    }
    WEFT_CHECK(fd >= 0, "cannot create a temporary file next to " << shown << ": " << errno_text());
    const char* p = static_cast<const char*>(data);
    size_t left = bytes;
    while (left > 0) {
        ssize_t n = ::write(fd, p, left);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            const std::string err = errno_text();
            ::close(fd);
            ::unlinkat(dir_fd, tmp.c_str(), 0);
            WEFT_FAIL("cannot write " << tmp << " next to " << shown << ": " << err);
        }
        p += n;
        left -= static_cast<size_t>(n);
    }
    // Readable by others like any file, writable by no one else whatever the umask (readers require it).
    ::fchmod(fd, 0644);
    if (::close(fd) != 0) {
        const std::string err = errno_text();
        ::unlinkat(dir_fd, tmp.c_str(), 0);
        WEFT_FAIL("cannot close " << tmp << " next to " << shown << ": " << err);
    }
    if (::renameat(dir_fd, tmp.c_str(), dir_fd, name.c_str()) != 0) {
        const std::string err = errno_text();
        ::unlinkat(dir_fd, tmp.c_str(), 0);
        WEFT_FAIL("cannot rename " << tmp << " to " << shown << ": " << err);
    }
}

}  // namespace

std::vector<char> encode_cache_entry(const Digest& key, const CacheEntry& entry) {
    const size_t payload_bytes = 3 * 8 + entry.lowered_name.size() + entry.cubin.size() + entry.log.size();
    std::vector<char> out(kHeaderBytes + payload_bytes);
    char* payload = out.data() + kHeaderBytes;
    char* p = payload;
    p = put_uint(p, entry.lowered_name.size(), 8);
    p = put_bytes(p, entry.lowered_name.data(), entry.lowered_name.size());
    p = put_uint(p, entry.cubin.size(), 8);
    p = put_bytes(p, entry.cubin.data(), entry.cubin.size());
    p = put_uint(p, entry.log.size(), 8);
    put_bytes(p, entry.log.data(), entry.log.size());
    const Digest payload_digest = sha256(payload, payload_bytes);

    char* h = out.data();
    h = put_bytes(h, kMagic, sizeof(kMagic));
    h = put_uint(h, kFormatVersion, 4);
    h = put_uint(h, kHeaderBytes, 4);
    h = put_bytes(h, key.data(), key.size());
    h = put_uint(h, payload_bytes, 8);
    put_bytes(h, payload_digest.data(), payload_digest.size());
    return out;
}

std::optional<CacheEntry> decode_cache_entry(const std::vector<char>& bytes, const Digest& key, std::string* why) {
    auto fail = [&](const std::string& reason) -> std::optional<CacheEntry> {
        if (why) *why = reason;
        return std::nullopt;
    };
    if (bytes.size() < kHeaderBytes) {
        return fail("file has " + std::to_string(bytes.size()) + " bytes, shorter than the " +
                    std::to_string(kHeaderBytes) + "-byte header");
    }
    const char* p = bytes.data();
    if (std::memcmp(p, kMagic, 8) != 0) return fail("bad magic (not a weft JIT cache entry)");
    const uint64_t version = get_uint(p + 8, 4);
    if (version != kFormatVersion) {
        return fail("format version " + std::to_string(version) + ", expected " + std::to_string(kFormatVersion));
    }
    if (get_uint(p + 12, 4) != kHeaderBytes) return fail("bad header size");
    if (std::memcmp(p + 16, key.data(), key.size()) != 0) return fail("entry belongs to another key");
    const uint64_t payload_bytes = get_uint(p + 48, 8);
    if (payload_bytes != bytes.size() - kHeaderBytes) {
        return fail("payload length " + std::to_string(payload_bytes) + " but the file holds " +
                    std::to_string(bytes.size() - kHeaderBytes) + " bytes after the header (truncated?)");
    }
    const char* payload = p + kHeaderBytes;
    const Digest digest = sha256(payload, payload_bytes);
    if (std::memcmp(p + 56, digest.data(), digest.size()) != 0) return fail("payload checksum mismatch");

    CacheEntry entry;
    size_t offset = 0;
    auto section = [&](auto assign) -> bool {
        if (payload_bytes - offset < 8) return false;
        const uint64_t n = get_uint(payload + offset, 8);
        offset += 8;
        if (payload_bytes - offset < n) return false;
        assign(payload + offset, static_cast<size_t>(n));
        offset += n;
        return true;
    };
    const bool ok = section([&](const char* d, size_t n) { entry.lowered_name.assign(d, n); }) &&
                    section([&](const char* d, size_t n) { entry.cubin.assign(d, d + n); }) &&
                    section([&](const char* d, size_t n) { entry.log.assign(d, n); });
    if (!ok || offset != payload_bytes) return fail("malformed payload sections");
    if (entry.lowered_name.empty() || entry.cubin.empty()) return fail("empty kernel name or cubin");
    return entry;
}

std::vector<char> read_file_bytes(const fs::path& path) {
    // O_NONBLOCK: a FIFO in the way must not block the open; only regular files are read.
    Fd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
    WEFT_CHECK(fd.get() >= 0, "cannot open " << path.string() << " for reading: " << errno_text());
    struct stat st {};
    WEFT_CHECK(::fstat(fd.get(), &st) == 0, "cannot examine " << path.string() << ": " << errno_text());
    WEFT_CHECK(S_ISREG(st.st_mode), path.string() << " is " << kind_of(st.st_mode) << ", not a regular file");
    std::vector<char> bytes(static_cast<size_t>(st.st_size));
    size_t done = 0;
    while (done < bytes.size()) {
        const ssize_t n = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
        if (n < 0 && errno == EINTR) continue;
        WEFT_CHECK(n > 0, "error reading " << path.string() << " (read " << done << " of " << bytes.size()
                                           << " bytes): " << (n < 0 ? errno_text() : "it shrank"));
        done += static_cast<size_t>(n);
    }
    return bytes;
}

std::optional<std::vector<char>> read_trusted_file(const fs::path& dir, const std::string& name, uint64_t max_bytes,
                                                   std::string* why) {
    why->clear();
    bool absent = false;
    Fd dir_fd(open_trusted_dir(AT_FDCWD, dir.c_str(), false, why, &absent));
    if (dir_fd.get() < 0) {
        if (absent) why->clear();
        else *why = "the folder " + dir.string() + " " + *why;
        return std::nullopt;
    }
    // O_NOFOLLOW: a symbolic link is refused; O_NONBLOCK: a FIFO does not block the open.
    Fd fd(::openat(dir_fd.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (fd.get() < 0) {
        if (errno != ENOENT) *why = errno == ELOOP ? "it is a symbolic link" : "it cannot be opened: " + errno_text();
        return std::nullopt;
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
        *why = "it cannot be examined: " + errno_text();
        return std::nullopt;
    }
    if (std::string reason = distrust(st, false); !reason.empty()) {
        *why = "it " + reason;
        return std::nullopt;
    }
    if (static_cast<uint64_t>(st.st_size) > max_bytes) {
        *why = "it holds " + std::to_string(st.st_size) + " bytes, over the limit of " + std::to_string(max_bytes);
        return std::nullopt;
    }
    std::vector<char> bytes(static_cast<size_t>(st.st_size));
    size_t done = 0;
    while (done < bytes.size()) {
        const ssize_t n = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            *why = "read " + std::to_string(done) + " of " + std::to_string(bytes.size()) + " bytes";
            return std::nullopt;
        }
        done += static_cast<size_t>(n);
    }
    return bytes;
}

void write_file_atomically(const fs::path& path, const void* data, size_t bytes) {
    const fs::path parent = path.has_parent_path() ? path.parent_path() : fs::path(".");
    Fd dir(::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    WEFT_CHECK(dir.get() >= 0, "cannot open the folder of " << path.string() << ": " << errno_text());
    write_atomically_at(dir.get(), path.filename().string(), path.string(), data, bytes);
}

void create_cache_folder(const fs::path& dir, std::error_code& ec) {
    ec.clear();
    if (dir.empty() || fs::exists(dir, ec)) return;
    if (dir.has_parent_path() && dir.parent_path() != dir) {
        create_cache_folder(dir.parent_path(), ec);
        if (ec) return;
    }
    // Created 0755 at once (a umask only takes bits away): a rank of the same job that finds it a moment later never
    // sees it writable by group (umask 0002), which it would distrust.
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) ec = std::error_code(errno, std::generic_category());
}

DiskCache::DiskCache(fs::path dir) : dir_(std::move(dir)), jit_dir_(dir_ / "jit") {
    std::error_code ec;
    create_cache_folder(jit_dir_, ec);
    WEFT_CHECK(!ec && fs::is_directory(jit_dir_),
               "cannot create the JIT cache folder " << jit_dir_.string() << ": " << ec.message());
    std::string why;
    Fd jit(open_jit_dir(&why));
    if (jit.get() < 0) {
        WEFT_LOG_WARN("jit: the cache folder " << why << "; its entries are misses and nothing is stored there");
        *folder_reported_ = true;
        return;
    }
    remove_abandoned_temporaries();
}

void DiskCache::remove_abandoned_temporaries() const {
    // A writer killed between creating its temporary (".<key>.wjit.tmp.<n>") and renaming it leaves it behind; a
    // live writer renames within seconds, so one untouched for an hour is abandoned.
    const auto now = fs::file_time_type::clock::now();
    std::error_code ec;
    for (fs::directory_iterator it(jit_dir_, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        if (name.empty() || name[0] != '.' || name.find(".tmp.") == std::string::npos) continue;
        std::error_code file_ec;
        if (!it->is_regular_file(file_ec) || file_ec) continue;
        const auto written = fs::last_write_time(it->path(), file_ec);
        if (file_ec || now - written < std::chrono::hours(1)) continue;
        if (fs::remove(it->path(), file_ec)) WEFT_LOG_DEBUG("jit: removed an abandoned temporary " << name);
    }
}

fs::path DiskCache::entry_path(const Digest& key) const { return jit_dir_ / (to_hex(key) + ".wjit"); }

int DiskCache::open_jit_dir(std::string* why) const {
    bool absent = false;
    Fd dir(open_trusted_dir(AT_FDCWD, dir_.c_str(), false, why, &absent));
    if (dir.get() < 0) {
        *why = dir_.string() + " " + *why;
        return -1;
    }
    const int jit = open_trusted_dir(dir.get(), "jit", true, why, &absent);
    if (jit < 0) *why = jit_dir_.string() + " " + *why;
    return jit;
}

DiskCache::LoadStatus DiskCache::load(const Digest& key, CacheEntry* out, std::string* why) const {
    const fs::path path = entry_path(key);
    std::string reason;
    // Untrusted folders and entries are misses: logged, never read.
    auto untrusted = [&](const std::string& text) {
        WEFT_LOG_WARN("jit: not using the cache entry " << path.string() << ": " << text);
        if (why) *why = text;
        return LoadStatus::kAbsent;
    };
    Fd jit(open_jit_dir(&reason));
    if (jit.get() < 0) {  // the folder itself: said once, not for every entry
        if (folder_reported_->exchange(true)) {
            WEFT_LOG_DEBUG("jit: not using the cache entry " << path.string() << ": the cache folder " << reason);
            if (why) *why = "the cache folder " + reason;
            return LoadStatus::kAbsent;
        }
        return untrusted("the cache folder " + reason);
    }
    // O_NOFOLLOW: a symbolic link is refused; O_NONBLOCK: a FIFO does not block the open.
    const std::string name = path.filename().string();
    Fd fd(::openat(jit.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (fd.get() < 0) {
        if (errno == ENOENT) return LoadStatus::kAbsent;
        return untrusted(errno == ELOOP ? "it is a symbolic link" : "it cannot be opened: " + errno_text());
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return untrusted("it cannot be examined: " + errno_text());
    reason = distrust(st, false);
    if (!reason.empty()) return untrusted("it " + reason);
    if (static_cast<uint64_t>(st.st_size) > kMaxEntryBytes) {
        return untrusted("it holds " + std::to_string(st.st_size) + " bytes, over the " +
                         std::to_string(kMaxEntryBytes) + "-byte limit of an entry");
    }
    std::vector<char> bytes(static_cast<size_t>(st.st_size));
    size_t done = 0;
    while (done < bytes.size()) {
        const ssize_t n = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            if (why) *why = "read " + std::to_string(done) + " of " + std::to_string(bytes.size()) + " bytes";
            return LoadStatus::kCorrupt;
        }
        done += static_cast<size_t>(n);
    }
    std::optional<CacheEntry> entry = decode_cache_entry(bytes, key, why);
    if (!entry) return LoadStatus::kCorrupt;
    *out = std::move(*entry);
    (void)::futimens(fd.get(), nullptr);  // its time is its last use (prune); best effort: another user's entry stays
    return LoadStatus::kHit;
}

DiskCache::PruneResult DiskCache::prune(std::chrono::hours unused_for) const {
    std::string why;
    Fd jit(open_jit_dir(&why));
    WEFT_CHECK(jit.get() >= 0, "not pruning the JIT cache: the cache folder " << why);
    PruneResult r;
    const auto cutoff = fs::file_time_type::clock::now() - unused_for;
    std::error_code ec;
    for (fs::directory_iterator it(jit_dir_, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        // Entries only: "<key>.wjit" (temporaries start with '.'; lock files may be held by a live process).
        if (name.empty() || name[0] == '.' || it->path().extension() != ".wjit") continue;
        std::error_code file_ec;
        if (!it->is_regular_file(file_ec) || file_ec) continue;
        const auto used = fs::last_write_time(it->path(), file_ec);
        if (file_ec) continue;
        if (used >= cutoff) {
            ++r.kept;
            continue;
        }
        const uintmax_t bytes = fs::file_size(it->path(), file_ec);
        if (::unlinkat(jit.get(), name.c_str(), 0) == 0) {
            ++r.removed;
            r.removed_bytes += file_ec ? 0 : bytes;
        }
    }
    // Lock files ("<key>.lock", one per key ever compiled): those whose entry is gone, made before the cutoff and held
    // by no one. One a process opens before the unlink and locks after it costs at most a second compile of its key
    // (entries are renamed into place whole), never a damaged entry.
    ec.clear();
    for (fs::directory_iterator it(jit_dir_, ec), end; !ec && it != end; it.increment(ec)) {
        const fs::path path = it->path();
        if (path.extension() != ".lock") continue;
        std::error_code file_ec;
        fs::path entry = path;
        entry.replace_extension(".wjit");
        if (fs::exists(entry, file_ec) || file_ec || !it->is_regular_file(file_ec) || file_ec) continue;
        const auto made = fs::last_write_time(path, file_ec);
        if (file_ec || made >= cutoff) continue;
        const std::string name = path.filename().string();
        Fd lock(::openat(jit.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
        if (lock.get() < 0 || ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) continue;  // held: a compile under way
        if (::unlinkat(jit.get(), name.c_str(), 0) == 0) ++r.removed_locks;
    }
    return r;
}

void DiskCache::store(const Digest& key, const CacheEntry& entry) const {
    std::string why;
    Fd jit(open_jit_dir(&why));
    WEFT_CHECK(jit.get() >= 0, "not storing in the JIT cache: the cache folder " << why);
    const std::vector<char> bytes = encode_cache_entry(key, entry);
    const fs::path path = entry_path(key);
    write_atomically_at(jit.get(), path.filename().string(), path.string(), bytes.data(), bytes.size());
}

void DiskCache::remove(const Digest& key) const {
    std::string why;
    Fd jit(open_jit_dir(&why));
    if (jit.get() >= 0) ::unlinkat(jit.get(), entry_path(key).filename().c_str(), 0);
}

fs::path DiskCache::lock_path(const Digest& key) const { return jit_dir_ / (to_hex(key) + ".lock"); }

FileLock::FileLock(const fs::path& path, std::chrono::milliseconds timeout) {
    // The lock file is opened like an entry: in a trusted folder, never through a symbolic link, never
    // blocking on a FIFO, and only a regular file of this user (or root) counts.
    std::string why;
    bool absent = false;
    const fs::path parent = path.has_parent_path() ? path.parent_path() : fs::path(".");
    Fd dir(open_trusted_dir(AT_FDCWD, parent.c_str(), false, &why, &absent));
    if (dir.get() < 0) {
        WEFT_LOG_WARN("jit: not locking " << path.string() << ": the folder "
                                          << (absent ? std::string("does not exist") : why));
        return;
    }
    Fd fd(::openat(dir.get(), path.filename().c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644));
    if (fd.get() < 0) {
        WEFT_LOG_WARN("jit: not locking " << path.string() << ": "
                                          << (errno == ELOOP ? std::string("it is a symbolic link") : errno_text()));
        return;
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) == 0 && st.st_uid == ::geteuid() && S_ISREG(st.st_mode)) {
        ::fchmod(fd.get(), st.st_mode & 0644);  // made under a permissive umask: others must not write it
        st.st_mode &= ~static_cast<mode_t>(S_IWGRP | S_IWOTH);
    }
    why = distrust(st, false);
    if (!why.empty()) {
        WEFT_LOG_WARN("jit: not locking " << path.string() << ": it " << why);
        return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::milliseconds(1);
    while (true) {
        if (::flock(fd.get(), LOCK_EX | LOCK_NB) == 0) {
            fd_ = fd.release();
            return;
        }
        if (errno != EWOULDBLOCK && errno != EINTR) {
            WEFT_LOG_WARN("jit: not locking " << path.string() << ": flock failed: " << errno_text());
            break;
        }
        if (std::chrono::steady_clock::now() >= deadline) {
            timed_out_ = true;
            break;
        }
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::milliseconds(20));
    }
}

FileLock::~FileLock() {
    if (fd_ >= 0) {
        ::flock(fd_, LOCK_UN);
        ::close(fd_);
    }
}

}  // namespace weft::jit
