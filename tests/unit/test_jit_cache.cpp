// SPDX-License-Identifier: MIT
// Unit tests of the JIT's building blocks: SHA-256, cache-entry encoding, file locks, ptxas report
// parsing, the spec-file format and the WEFT_JIT_* options.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <thread>

#include "support/jit_testing.hpp"
#include "weft/jit/aot.hpp"
#include "weft/jit/cache.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/jit/hash.hpp"
#include "weft/jit/options.hpp"
#include "weft/runtime/error.hpp"

namespace weft::jit {
namespace {

namespace fs = std::filesystem;
using weft::testing::ScopedEnv;
using weft::testing::TempDir;

TEST(JitHash, Sha256KnownVectors) {
    // FIPS 180-2 test vectors.
    EXPECT_EQ(to_hex(sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    EXPECT_EQ(to_hex(sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    Sha256 h;
    h.update("ab").update("c");
    EXPECT_EQ(to_hex(h.finish()), to_hex(sha256("abc")));
    // Fields are length-prefixed: the split point matters.
    Sha256 a, b;
    a.field("ab").field("c");
    b.field("a").field("bc");
    EXPECT_NE(to_hex(a.finish()), to_hex(b.finish()));
}

CacheEntry sample_entry() {
    CacheEntry e;
    e.lowered_name = "_Z6kernelv";
    for (int i = 0; i < 1000; ++i) e.cubin.push_back(static_cast<char>(i * 7));
    e.log = "ptxas info    : Used 10 registers";
    return e;
}

TEST(JitCacheEntry, RoundTrips) {
    const Digest key = sha256("key");
    const CacheEntry e = sample_entry();
    std::string why;
    const auto back = decode_cache_entry(encode_cache_entry(key, e), key, &why);
    ASSERT_TRUE(back.has_value()) << why;
    EXPECT_EQ(back->lowered_name, e.lowered_name);
    EXPECT_EQ(back->cubin, e.cubin);
    EXPECT_EQ(back->log, e.log);
}

TEST(JitCacheEntry, EveryDamageIsDetected) {
    const Digest key = sha256("key");
    const std::vector<char> good = encode_cache_entry(key, sample_entry());
    auto rejected = [&](std::vector<char> bytes, const Digest& k, const std::string& reason_part) {
        std::string why;
        EXPECT_FALSE(decode_cache_entry(bytes, k, &why).has_value());
        EXPECT_NE(why.find(reason_part), std::string::npos) << why;
    };
    // Any single flipped byte anywhere is caught (header fields or payload).
    for (size_t i = 0; i < good.size(); i += 7) {
        std::vector<char> bad = good;
        bad[i] = static_cast<char>(bad[i] ^ 0x01);
        std::string why;
        EXPECT_FALSE(decode_cache_entry(bad, key, &why).has_value()) << "flip at byte " << i;
    }
    rejected(std::vector<char>(good.begin(), good.begin() + 10), key, "shorter than");
    rejected(std::vector<char>(good.begin(), good.end() - 1), key, "truncated");
    std::vector<char> longer = good;
    longer.push_back('x');
    rejected(longer, key, "payload length");
    rejected(good, sha256("other key"), "another key");
    std::vector<char> magic = good;
    magic[0] = 'X';
    rejected(magic, key, "magic");
}

TEST(JitDiskCache, StoreLoadRemove) {
    TempDir dir("weft_jit_cache");
    DiskCache cache(dir.path());
    const Digest key = sha256("k1");
    CacheEntry out;
    EXPECT_EQ(cache.load(key, &out), DiskCache::LoadStatus::kAbsent);
    cache.store(key, sample_entry());
    EXPECT_EQ(cache.load(key, &out), DiskCache::LoadStatus::kHit);
    EXPECT_EQ(out.cubin, sample_entry().cubin);
    EXPECT_EQ(fs::status(cache.entry_path(key)).permissions() & fs::perms::others_read, fs::perms::others_read);
    // Another key's entry copied over this one is refused.
    const Digest other = sha256("k2");
    cache.store(other, sample_entry());
    fs::copy_file(cache.entry_path(other), cache.entry_path(key), fs::copy_options::overwrite_existing);
    std::string why;
    EXPECT_EQ(cache.load(key, &out, &why), DiskCache::LoadStatus::kCorrupt);
    EXPECT_NE(why.find("another key"), std::string::npos);
    cache.remove(key);
    EXPECT_EQ(cache.load(key, &out), DiskCache::LoadStatus::kAbsent);
}

TEST(JitDiskCache, AbandonedTemporariesAreRemovedFreshOnesKept) {
    TempDir dir("weft_jit_tmp");
    { DiskCache make(dir.path()); }
    const fs::path jit = dir.path() / "jit";
    const auto write = [&](const std::string& name) {
        std::ofstream(jit / name) << "partial";
        return jit / name;
    };
    const fs::path old_tmp = write(".abc.wjit.tmp.123456");
    const fs::path fresh_tmp = write(".def.wjit.tmp.654321");
    const fs::path entry = write("0123.wjit");
    const auto two_hours_ago = fs::file_time_type::clock::now() - std::chrono::hours(2);
    fs::last_write_time(old_tmp, two_hours_ago);
    fs::last_write_time(entry, two_hours_ago);
    DiskCache cache(dir.path());
    EXPECT_FALSE(fs::exists(old_tmp));
    EXPECT_TRUE(fs::exists(fresh_tmp));  // maybe a live writer's
    EXPECT_TRUE(fs::exists(entry));      // entries are never aged out
}

// prune removes the entries unused for longer than asked and keeps the rest; a load counts as a use.
TEST(JitDiskCache, PruneRemovesEntriesUnusedForLongerThanAsked) {
    TempDir dir("weft_jit_prune");
    DiskCache cache(dir.path());
    const Digest stale = sha256("stale"), used = sha256("used"), fresh = sha256("fresh");
    for (const Digest& k : {stale, used, fresh}) cache.store(k, sample_entry());
    const auto ten_days_ago = fs::file_time_type::clock::now() - std::chrono::hours(24 * 10);
    fs::last_write_time(cache.entry_path(stale), ten_days_ago);
    fs::last_write_time(cache.entry_path(used), ten_days_ago);
    CacheEntry out;
    ASSERT_EQ(cache.load(used, &out), DiskCache::LoadStatus::kHit);      // a use: its time is now
    std::ofstream(dir.path() / "jit" / ".old.wjit.tmp.1") << "partial";  // not an entry: left to the constructor
    fs::last_write_time(dir.path() / "jit" / ".old.wjit.tmp.1", ten_days_ago);
    const DiskCache::PruneResult r = cache.prune(std::chrono::hours(24 * 7));
    EXPECT_EQ(r.removed, 1u);
    EXPECT_EQ(r.kept, 2u);
    EXPECT_EQ(r.removed_bytes, fs::file_size(cache.entry_path(fresh)));
    EXPECT_FALSE(fs::exists(cache.entry_path(stale)));
    EXPECT_EQ(cache.load(used, &out), DiskCache::LoadStatus::kHit);
    EXPECT_EQ(cache.load(fresh, &out), DiskCache::LoadStatus::kHit);
    EXPECT_TRUE(fs::exists(dir.path() / "jit" / ".old.wjit.tmp.1"));
}

// prune removes the lock files of keys without an entry once they are older than the cutoff, and none that a process
// holds or whose entry is there.
TEST(JitDiskCache, PruneRemovesOldLockFilesOfKeysWithoutAnEntry) {
    TempDir dir("weft_jit_prune_locks");
    DiskCache cache(dir.path());
    const Digest gone = sha256("gone"), held = sha256("held"), kept = sha256("kept"), young = sha256("young");
    cache.store(kept, sample_entry());
    const auto ten_days_ago = fs::file_time_type::clock::now() - std::chrono::hours(24 * 10);
    for (const Digest& k : {gone, held, kept, young}) {
        std::ofstream(cache.lock_path(k)).close();
        if (k != young) fs::last_write_time(cache.lock_path(k), ten_days_ago);
    }
    const FileLock holding(cache.lock_path(held), std::chrono::milliseconds(1000));
    ASSERT_TRUE(holding.owns());
    const DiskCache::PruneResult r = cache.prune(std::chrono::hours(24 * 7));
    EXPECT_EQ(r.removed_locks, 1u);
    EXPECT_FALSE(fs::exists(cache.lock_path(gone)));
    EXPECT_TRUE(fs::exists(cache.lock_path(held)));   // a compile under way
    EXPECT_TRUE(fs::exists(cache.lock_path(kept)));   // its entry is there (and fresh)
    EXPECT_TRUE(fs::exists(cache.lock_path(young)));  // newer than the cutoff
}

TEST(JitDiskCache, UnusableFolderIsAnErrorNamingIt) {
    TempDir dir("weft_jit_bad");
    weft::testing::write_text_file(dir / "a_file", "not a folder");  // works even as root
    try {
        DiskCache cache(dir / "a_file");
        FAIL() << "a cache inside a regular file";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("a_file"), std::string::npos) << e.what();
    }
    // The compiler degrades to no disk cache (with a warning) instead of failing.
    CompilerConfig config = weft::testing::isolated_compiler_config(dir / "a_file");
    Compiler compiler(config);
    EXPECT_FALSE(compiler.cache_dir().has_value());
}

TEST(JitFileLock, ExcludesOtherHoldersAndTimesOut) {
    TempDir dir("weft_jit_lock");
    const fs::path path = dir / "x.lock";
    auto holder = std::make_unique<FileLock>(path, std::chrono::milliseconds(1000));
    ASSERT_TRUE(holder->owns());
    {
        FileLock second(path, std::chrono::milliseconds(50));
        EXPECT_FALSE(second.owns()) << "a second lock on the same file must wait, then give up";
    }
    std::atomic<bool> got{false};
    std::thread waiter([&] {
        FileLock third(path, std::chrono::milliseconds(5000));
        got = third.owns();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_FALSE(got.load());
    holder.reset();  // release: the waiter gets it
    waiter.join();
    EXPECT_TRUE(got.load());
}

/// Runs `fn` on a thread and waits at most 2 s for it. Returns the seconds it took, or -1 when it was still
/// blocked at 2 s; `unblock` is then called (to end a blocked open) before the thread is joined.
double seconds_to_finish(const std::function<void()>& fn, const std::function<void()>& unblock = [] {}) {
    std::atomic<bool> done{false};
    const auto start = std::chrono::steady_clock::now();
    std::thread t([&] {
        fn();
        done = true;
    });
    while (!done.load() && std::chrono::steady_clock::now() - start < std::chrono::seconds(2)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const double seconds =
        done.load() ? std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() : -1.0;
    if (!done.load()) unblock();
    t.join();
    return seconds;
}

TEST(JitDiskCache, UntrustedEntriesAreMisses) {
    TempDir dir("weft_jit_trust");
    DiskCache cache(dir / "cache");
    const fs::path jit = dir / "cache" / "jit";
    const CacheEntry entry = sample_entry();
    // A miss, answered at once (well within a second on a loaded machine; a blocked read would wait for ever).
    auto expect_miss = [&](const Digest& key, const char* what, const std::function<void()>& unblock = [] {}) {
        DiskCache::LoadStatus status = DiskCache::LoadStatus::kHit;
        std::string why;
        CacheEntry out;
        const double seconds = seconds_to_finish([&] { status = cache.load(key, &out, &why); }, unblock);
        EXPECT_GE(seconds, 0.0) << what << ": load() blocked";
        EXPECT_LT(seconds, 1.0) << what;
        EXPECT_EQ(status, DiskCache::LoadStatus::kAbsent) << what << ": " << why;
        EXPECT_FALSE(why.empty()) << what << ": the reason is reported";
    };

    // A FIFO where an entry belongs: opening it for reading would wait for a writer forever.
    const Digest fifo_key = sha256("fifo");
    ASSERT_EQ(::mkfifo(cache.entry_path(fifo_key).c_str(), 0644), 0);
    expect_miss(fifo_key, "FIFO", [&] {
        const int w = ::open(cache.entry_path(fifo_key).c_str(), O_WRONLY | O_NONBLOCK);
        if (w >= 0) ::close(w);
    });
    // A symbolic link to a valid entry for the same key, outside the cache.
    const Digest link_key = sha256("link");
    const std::vector<char> outside = encode_cache_entry(link_key, entry);
    write_file_atomically(dir / "outside.wjit", outside.data(), outside.size());
    fs::create_symlink(dir / "outside.wjit", cache.entry_path(link_key));
    expect_miss(link_key, "symbolic link");
    // A sparse file of 1 GiB: refused by its size, never read.
    const Digest sparse_key = sha256("sparse");
    {
        const int fd = ::open(cache.entry_path(sparse_key).c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
        ASSERT_GE(fd, 0);
        ASSERT_EQ(::ftruncate(fd, off_t{1} << 30), 0);
        ::close(fd);
    }
    expect_miss(sparse_key, "sparse 1 GiB entry");
    // An entry others may write.
    const Digest writable_key = sha256("writable");
    cache.store(writable_key, entry);
    ASSERT_EQ(::chmod(cache.entry_path(writable_key).c_str(), 0666), 0);
    expect_miss(writable_key, "world-writable entry");

    // A valid entry becomes a miss when its folder (or the cache folder) is writable by others, and a hit
    // again with the sticky bit (others may add files, not replace ours).
    const Digest key = sha256("valid");
    cache.store(key, entry);
    CacheEntry out;
    ASSERT_EQ(cache.load(key, &out), DiskCache::LoadStatus::kHit);
    ASSERT_EQ(::chmod(jit.c_str(), 0777), 0);
    expect_miss(key, "0777 jit folder");
    EXPECT_THROW(cache.store(sha256("new"), entry), Error);  // nothing is stored there either
    ASSERT_EQ(::chmod(jit.c_str(), 01777), 0);
    EXPECT_EQ(cache.load(key, &out), DiskCache::LoadStatus::kHit);
    ASSERT_EQ(::chmod(jit.c_str(), 0755), 0);
    ASSERT_EQ(::chmod((dir / "cache").c_str(), 0777), 0);
    expect_miss(key, "0777 cache folder");
    ASSERT_EQ(::chmod((dir / "cache").c_str(), 0755), 0);
    EXPECT_EQ(cache.load(key, &out), DiskCache::LoadStatus::kHit);

    // A planted entry verifies (the checksum has no key): only its owner gives it away. CI runs as root,
    // which can hand a file to another user.
    if (::geteuid() != 0) GTEST_SKIP() << "the planted-entry case needs root (chown)";
    ASSERT_EQ(::chown(cache.entry_path(key).c_str(), 65534, 65534), 0);
    expect_miss(key, "entry owned by another user");
    ASSERT_EQ(::chown(jit.c_str(), 65534, 65534), 0);
    ASSERT_EQ(::chown(cache.entry_path(key).c_str(), 0, 0), 0);
    expect_miss(key, "jit folder owned by another user");
}

TEST(JitFileLock, UntrustedLockFilesAreNotTaken) {
    TempDir dir("weft_jit_lock_trust");
    auto not_taken_quickly = [&](const fs::path& path, const char* what) {
        bool owns = true;
        const double seconds = seconds_to_finish([&] {
            FileLock lock(path, std::chrono::milliseconds(5000));
            owns = lock.owns();
        });
        EXPECT_GE(seconds, 0.0) << what << ": blocked";
        EXPECT_LT(seconds, 1.0) << what;
        EXPECT_FALSE(owns) << what;
    };
    // A symbolic link: following it would create (and lock) a file wherever it points.
    fs::create_symlink(dir / "elsewhere", dir / "a.lock");
    not_taken_quickly(dir / "a.lock", "symbolic link");
    EXPECT_FALSE(fs::exists(dir / "elsewhere")) << "the link was followed";
    ASSERT_EQ(::mkfifo((dir / "b.lock").c_str(), 0644), 0);
    not_taken_quickly(dir / "b.lock", "FIFO");
    fs::create_directories(dir / "open");
    ASSERT_EQ(::chmod((dir / "open").c_str(), 0777), 0);
    not_taken_quickly(dir / "open" / "c.lock", "lock in a 0777 folder");
    // A lock file made under a permissive umask is made private to this user, and taken.
    const mode_t old_mask = ::umask(0);
    {
        FileLock lock(dir / "d.lock", std::chrono::milliseconds(1000));
        EXPECT_TRUE(lock.owns());
    }
    ::umask(old_mask);
    EXPECT_EQ(fs::status(dir / "d.lock").permissions() & fs::perms::others_write, fs::perms::none);
}

TEST(JitDiskCache, ReadFileBytesRefusesAFifo) {
    TempDir dir("weft_jit_fifo");
    ASSERT_EQ(::mkfifo((dir / "f").c_str(), 0644), 0);
    std::string error;
    const double seconds = seconds_to_finish(
        [&] {
            try {
                read_file_bytes(dir / "f");
            } catch (const Error& e) {
                error = e.what();
            }
        },
        [&] {
            const int w = ::open((dir / "f").c_str(), O_WRONLY | O_NONBLOCK);
            if (w >= 0) ::close(w);
        });
    EXPECT_GE(seconds, 0.0) << "read_file_bytes blocked";
    EXPECT_NE(error.find("a FIFO, not a regular file"), std::string::npos) << error;
}

TEST(JitPtxasInfo, ParsesTheKernelsBlock) {
    const std::string log =
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function '_Z5otherv' for 'sm_90a'\n"
        "ptxas info    : Used 99 registers, used 0 barriers\n"
        "ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_90a'\n"
        "ptxas info    : Function properties for _Z6kernelv\n"
        "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem\n";
    const PtxasInfo info = parse_ptxas_info(log, "_Z6kernelv");
    EXPECT_EQ(info.registers, 40);
    EXPECT_EQ(info.stack_frame_bytes, 16);
    EXPECT_EQ(info.spill_store_bytes, 8);
    EXPECT_EQ(info.spill_load_bytes, 4);
    EXPECT_EQ(info.static_smem_bytes, 1024);
    EXPECT_EQ(info.text.find("99"), std::string::npos);
    EXPECT_EQ(parse_ptxas_info(log, "_Z7missingv").registers, -1);
    EXPECT_EQ(parse_ptxas_info("", "").registers, -1);
}

TEST(JitSpecFile, ParsesLinesCommentsAndContinuations) {
    const std::string text =
        "# weft-compile specs\n"
        "\n"
        "  jit_selftest/saxpy.cuh | ns::saxpy<ns::C{.a = 1}>  \n"
        "gemm/gemm_sm90.cuh|ns::gemm<ns::G{.flags = ns::kA | ns::kB, \\\n"
        "   .tile_m = 128}>\n";
    const auto specs = parse_spec_file(text, "specs.txt");
    ASSERT_EQ(specs.size(), 2u);
    EXPECT_EQ(specs[0].header, "jit_selftest/saxpy.cuh");
    EXPECT_EQ(specs[0].instantiation, "ns::saxpy<ns::C{.a = 1}>");
    EXPECT_NE(specs[0].description.find("specs.txt:3"), std::string::npos);
    EXPECT_EQ(specs[1].header, "gemm/gemm_sm90.cuh");
    EXPECT_EQ(specs[1].instantiation, "ns::gemm<ns::G{.flags = ns::kA | ns::kB,    .tile_m = 128}>")
        << "split at the first '|' only; continuation joined";
    try {
        parse_spec_file("ok.cuh|k\nno separator here\n", "bad.txt");
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("bad.txt:2"), std::string::npos) << e.what();
    }
    EXPECT_THROW(parse_spec_file("|kernel\n", "x"), Error);
    EXPECT_THROW(parse_spec_file("a.cuh|k \\\n", "x"), Error);
}

TEST(JitOptions, EnvironmentOverridesTheSpec) {
    CompileOptions base;
    base.lineinfo = true;
    {
        ScopedEnv a("WEFT_JIT_LINEINFO", "0");
        ScopedEnv b("WEFT_JIT_MAXRREGCOUNT", "128");
        ScopedEnv c("WEFT_JIT_VERBOSE_PTXAS", "yes");
        ScopedEnv d("WEFT_JIT_DUMP_DIR", "/tmp/dump");
        ScopedEnv e("WEFT_JIT_LTO", "on");
        const CompileOptions o = apply_env_options(base);
        EXPECT_FALSE(o.lineinfo);
        EXPECT_EQ(o.max_registers, 128);
        EXPECT_TRUE(o.verbose_ptxas);
        EXPECT_EQ(o.dump_dir, "/tmp/dump");
        EXPECT_TRUE(o.lto);
    }
    {
        ScopedEnv a("WEFT_JIT_LINEINFO", std::nullopt);
        ScopedEnv b("WEFT_JIT_MAXRREGCOUNT", std::nullopt);
        ScopedEnv c("WEFT_JIT_VERBOSE_PTXAS", std::nullopt);
        ScopedEnv d("WEFT_JIT_DUMP_DIR", std::nullopt);
        ScopedEnv e("WEFT_JIT_LTO", std::nullopt);
        const CompileOptions o = apply_env_options(base);
        EXPECT_TRUE(o.lineinfo) << "unset variables leave the spec alone";
        EXPECT_EQ(o.max_registers, 0);
    }
    for (const char* bad : {"lots", "-1", "300"}) {
        ScopedEnv b("WEFT_JIT_MAXRREGCOUNT", bad);
        try {
            apply_env_options(base);
            FAIL() << bad;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("WEFT_JIT_MAXRREGCOUNT"), std::string::npos) << e.what();
        }
    }
    // canonical() separates list items unambiguously.
    CompileOptions x, y;
    x.defines = {"A", "B"};
    y.defines = {"A B"};
    EXPECT_NE(x.canonical(), y.canonical());
}

TEST(JitOptions, IncludeFlagsAreRefusedTheKeyWouldNotHashTheirHeaders) {
    for (const char* flag :
         {"-I/my/headers", "--include-path=/my/headers", "-include", "--pre-include=cfg.h", "-isystem/x"}) {
        CompileOptions o;
        o.extra_flags = {"-DOK=1", flag};
        try {
            o.check();
            FAIL() << flag;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("extra_include_roots"), std::string::npos) << e.what();
        }
    }
    CompileOptions fine;
    fine.extra_flags = {"-DX=1", "--use_fast_math", "-Xptxas=-v"};
    EXPECT_NO_THROW(fine.check());
    fine.max_registers = 64;
    fine.lineinfo = true;
    EXPECT_NE(fine.describe().find("--maxrregcount=64"), std::string::npos) << fine.describe();
    EXPECT_NE(fine.describe().find("--use_fast_math"), std::string::npos) << fine.describe();
}

TEST(JitOptions, DisableCacheTurnsTheDiskLayerOff) {
    {
        ScopedEnv off("WEFT_JIT_DISABLE_CACHE", "1");
        EXPECT_FALSE(CompilerConfig::from_env().cache_dir.has_value());
    }
    ScopedEnv on("WEFT_JIT_DISABLE_CACHE", std::nullopt);
    ScopedEnv dir("WEFT_CACHE_DIR", "/some/where");
    EXPECT_EQ(CompilerConfig::from_env().cache_dir, fs::path("/some/where"));
}

}  // namespace
}  // namespace weft::jit
