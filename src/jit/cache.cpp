// SPDX-License-Identifier: MIT
// The on-disk kernel cache: entry encoding, atomic writes, per-key file locks.
#include "weft/jit/cache.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

#include "weft/runtime/error.hpp"

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
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    WEFT_CHECK(in.good(), "cannot open " << path.string() << " for reading");
    const std::streamoff size = in.tellg();
    WEFT_CHECK(size >= 0, "cannot size " << path.string());
    std::vector<char> bytes(static_cast<size_t>(size));
    in.seekg(0);
    in.read(bytes.data(), size);
    WEFT_CHECK(in.gcount() == size, "error reading " << path.string() << " (read " << in.gcount() << " of " << size
                                                      << " bytes)");
    return bytes;
}

void write_file_atomically(const fs::path& path, const void* data, size_t bytes) {
    std::string tmp = path.parent_path().string();
    tmp += "/.";
    tmp += path.filename().string();
    tmp += ".tmp.XXXXXX";
    int fd = mkstemp(tmp.data());
    WEFT_CHECK(fd >= 0, "cannot create a temporary file next to " << path.string() << ": " << errno_text());
    const char* p = static_cast<const char*>(data);
    size_t left = bytes;
    while (left > 0) {
        ssize_t n = ::write(fd, p, left);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            const std::string err = errno_text();
            ::close(fd);
            ::unlink(tmp.c_str());
            WEFT_FAIL("cannot write " << tmp << ": " << err);
        }
        p += n;
        left -= static_cast<size_t>(n);
    }
    // mkstemp creates 0600; cache entries are meant to be shared like any other file.
    ::fchmod(fd, 0644);
    if (::close(fd) != 0) {
        const std::string err = errno_text();
        ::unlink(tmp.c_str());
        WEFT_FAIL("cannot close " << tmp << ": " << err);
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
        const std::string err = errno_text();
        ::unlink(tmp.c_str());
        WEFT_FAIL("cannot rename " << tmp << " to " << path.string() << ": " << err);
    }
}

DiskCache::DiskCache(fs::path dir) : dir_(std::move(dir)), jit_dir_(dir_ / "jit") {
    std::error_code ec;
    fs::create_directories(jit_dir_, ec);
    WEFT_CHECK(!ec && fs::is_directory(jit_dir_),
               "cannot create the JIT cache folder " << jit_dir_.string() << ": " << ec.message());
}

fs::path DiskCache::entry_path(const Digest& key) const { return jit_dir_ / (to_hex(key) + ".wjit"); }

DiskCache::LoadStatus DiskCache::load(const Digest& key, CacheEntry* out, std::string* why) const {
    const fs::path path = entry_path(key);
    std::error_code ec;
    if (!fs::exists(path, ec)) return LoadStatus::kAbsent;
    std::vector<char> bytes;
    try {
        bytes = read_file_bytes(path);
    } catch (const Error& e) {
        if (why) *why = e.what();
        return LoadStatus::kCorrupt;
    }
    std::optional<CacheEntry> entry = decode_cache_entry(bytes, key, why);
    if (!entry) return LoadStatus::kCorrupt;
    *out = std::move(*entry);
    return LoadStatus::kHit;
}

void DiskCache::store(const Digest& key, const CacheEntry& entry) const {
    const std::vector<char> bytes = encode_cache_entry(key, entry);
    write_file_atomically(entry_path(key), bytes.data(), bytes.size());
}

void DiskCache::remove(const Digest& key) const {
    std::error_code ec;
    fs::remove(entry_path(key), ec);
}

fs::path DiskCache::lock_path(const Digest& key) const { return jit_dir_ / (to_hex(key) + ".lock"); }

FileLock::FileLock(const fs::path& path, std::chrono::milliseconds timeout) {
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::milliseconds(1);
    while (true) {
        if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
            fd_ = fd;
            return;
        }
        if (errno != EWOULDBLOCK && errno != EINTR) break;
        if (std::chrono::steady_clock::now() >= deadline) break;
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::milliseconds(20));
    }
    ::close(fd);
}

FileLock::~FileLock() {
    if (fd_ >= 0) {
        ::flock(fd_, LOCK_UN);
        ::close(fd_);
    }
}

}  // namespace weft::jit
