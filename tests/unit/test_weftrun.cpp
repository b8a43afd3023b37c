// SPDX-License-Identifier: MIT
// Unit tests for the weftrun launcher, run as a real process over CPU-only child programs (sh, sleep).
#include <gtest/gtest.h>

#include <limits.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "weft/runtime/launch_env.hpp"
#include "weft/runtime/rendezvous.hpp"

extern char** environ;  // NOLINT: POSIX

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

#ifdef WEFT_WEFTRUN_PATH
constexpr const char* kWeftrun = WEFT_WEFTRUN_PATH;
#else
constexpr const char* kWeftrun = nullptr;
#endif

struct Result {
    int exit_code = -1;  // -signal when weftrun itself died by a signal
    std::string out, err;
    double seconds = 0;
};

/// weftrun as a child process with its stdout and stderr captured; every wait is bounded.
class Weftrun {
public:
    /// `ignored`: signals weftrun starts with ignored (as under nohup, or a background job of a script).
    explicit Weftrun(const std::vector<std::string>& args, const std::vector<std::string>& env_overrides = {},
                     const std::vector<int>& ignored = {}) {
        std::vector<std::string> argv_s = {kWeftrun};
        argv_s.insert(argv_s.end(), args.begin(), args.end());
        std::vector<std::string> env_s;
        for (char** p = environ; *p != nullptr; ++p) {
            std::string e(*p);
            std::string name = e.substr(0, e.find('='));
            bool overridden = std::any_of(env_overrides.begin(), env_overrides.end(),
                                          [&](const std::string& o) { return o.rfind(name + "=", 0) == 0; });
            if (!overridden) env_s.push_back(e);
        }
        env_s.insert(env_s.end(), env_overrides.begin(), env_overrides.end());
        std::vector<char*> argv, envp;
        for (auto& a : argv_s) argv.push_back(a.data());
        argv.push_back(nullptr);
        for (auto& e : env_s) envp.push_back(e.data());
        envp.push_back(nullptr);
        int out[2], err[2];
        if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
        start_ = Clock::now();
        pid_ = ::fork();
        if (pid_ == 0) {
            for (int sig : ignored) ::signal(sig, SIG_IGN);
            ::dup2(out[1], 1);
            ::dup2(err[1], 2);
            ::execve(argv[0], argv.data(), envp.data());
            ::_exit(99);
        }
        ::close(out[1]);
        ::close(err[1]);
        out_fd_ = out[0];
        err_fd_ = err[0];
    }

    ~Weftrun() {
        if (pid_ > 0 && !reaped_) {
            ::kill(pid_, SIGKILL);
            ::waitpid(pid_, nullptr, 0);
        }
        if (out_fd_ >= 0) ::close(out_fd_);
        if (err_fd_ >= 0) ::close(err_fd_);
    }

    /// Reads output until stdout holds `needle` `count` times; false after `limit`.
    bool wait_for_stdout(const std::string& needle, int count, milliseconds limit) {
        auto deadline = Clock::now() + limit;
        while (occurrences(result_.out, needle) < count) {
            if (Clock::now() >= deadline || !pump(deadline)) return occurrences(result_.out, needle) >= count;
        }
        return true;
    }

    void send_signal(int sig) { ::kill(pid_, sig); }
    pid_t pid() const { return pid_; }

    /// Reads everything and reaps weftrun; kills it (and fails the test) after `limit`.
    Result finish(milliseconds limit = milliseconds(20000)) {
        auto deadline = Clock::now() + limit;
        while ((out_fd_ >= 0 || err_fd_ >= 0) && Clock::now() < deadline) pump(deadline);
        int status = 0;
        while (true) {
            pid_t r = ::waitpid(pid_, &status, WNOHANG);
            if (r == pid_) break;
            if (Clock::now() >= deadline) {
                ADD_FAILURE() << "weftrun did not finish within " << limit.count() << " ms; killing it";
                ::kill(pid_, SIGKILL);
                ::waitpid(pid_, &status, 0);
                break;
            }
            ::usleep(2000);
        }
        reaped_ = true;
        result_.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
        result_.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
        return result_;
    }

private:
    static int occurrences(const std::string& text, const std::string& needle) {
        int n = 0;
        for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) ++n;
        return n;
    }

    /// One poll over the open pipes; false when both are closed.
    bool pump(Clock::time_point deadline) {
        std::vector<pollfd> fds;
        if (out_fd_ >= 0) fds.push_back({out_fd_, POLLIN, 0});
        if (err_fd_ >= 0) fds.push_back({err_fd_, POLLIN, 0});
        if (fds.empty()) return false;
        auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
        if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(left, 0))) <= 0) return true;
        for (auto& p : fds) {
            if (p.revents == 0) continue;
            char buf[65536];
            ssize_t n = ::read(p.fd, buf, sizeof(buf));
            bool is_out = p.fd == out_fd_;
            if (n <= 0) {
                ::close(p.fd);
                (is_out ? out_fd_ : err_fd_) = -1;
            } else {
                (is_out ? result_.out : result_.err).append(buf, static_cast<size_t>(n));
            }
        }
        return true;
    }

    pid_t pid_ = -1;
    bool reaped_ = false;
    int out_fd_ = -1, err_fd_ = -1;
    Clock::time_point start_;
    Result result_;
};

Result run(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
    return Weftrun(args, env).finish();
}

std::vector<std::string> lines(const std::string& text) {
    std::vector<std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

class WeftrunTest : public ::testing::Test {
protected:
    void SetUp() override {
        if (kWeftrun == nullptr) GTEST_SKIP() << "weftrun was not built (WEFT_BUILD_TOOLS=OFF)";
    }
};

TEST_F(WeftrunTest, EchoRankPrintsEachRankWithItsPrefix) {
    Result r = run({"-n", "3", "--", "sh", "-c", "echo $RANK"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    std::vector<std::string> got = lines(r.out);
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, (std::vector<std::string>{"[rank 0] 0", "[rank 1] 1", "[rank 2] 2"})) << r.out;
    EXPECT_EQ(r.err, "");
}

TEST_F(WeftrunTest, SetsTheLaunchEnvironment) {
    const char* script = "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT "
                         "$WEFT_JOB_TOKEN ${CUDA_VISIBLE_DEVICES-unset} $WEFT_RUN_ID\"";
    auto parse = [](const Result& r, int num_ranks) {
        std::vector<std::vector<std::string>> rows(static_cast<size_t>(num_ranks));
        for (const std::string& line : lines(r.out)) {
            std::istringstream in(line);
            std::string tag, rank_text;
            in >> tag >> rank_text;  // "[rank" "K]"
            int rank = std::stoi(rank_text);
            std::vector<std::string> fields;
            for (std::string f; in >> f;) fields.push_back(f);
            rows.at(static_cast<size_t>(rank)) = fields;
        }
        return rows;
    };
    Result r = run({"-n", "4", "--", "sh", "-c", script}, {"CUDA_VISIBLE_DEVICES=7"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto rows = parse(r, 4);
    std::set<std::string> ports, tokens, run_ids;
    for (int k = 0; k < 4; ++k) {
        const auto& f = rows[static_cast<size_t>(k)];
        ASSERT_EQ(f.size(), 9u) << r.out;
        EXPECT_EQ(f[0], std::to_string(k));
        EXPECT_EQ(f[1], "4");
        EXPECT_EQ(f[2], std::to_string(k));
        EXPECT_EQ(f[3], "4");
        EXPECT_EQ(f[4], "127.0.0.1");
        int port = std::stoi(f[5]);
        EXPECT_TRUE(port > 0 && port < 65536);
        EXPECT_EQ(f[6].size(), 64u);
        EXPECT_EQ(f[6].find_first_not_of("0123456789abcdef"), std::string::npos);
        EXPECT_EQ(f[7], "7");  // without --gpus the inherited value is left alone
        EXPECT_EQ(f[8].size(), 32u);  // the run id: public, its own random draw
        EXPECT_EQ(f[6].find(f[8]), std::string::npos);
        ports.insert(f[5]);
        tokens.insert(f[6]);
        run_ids.insert(f[8]);
    }
    EXPECT_EQ(ports.size(), 1u);
    EXPECT_EQ(tokens.size(), 1u);
    EXPECT_EQ(run_ids.size(), 1u);

    // --gpus: rank i gets element i % len; --port is passed through; a new job gets a new token.
    Result g =
        run({"-n", "3", "--gpus", "2,5", "--port", "41234", "--", "sh", "-c", script}, {"CUDA_VISIBLE_DEVICES="});
    ASSERT_EQ(g.exit_code, 0) << g.err;
    auto grows = parse(g, 3);
    EXPECT_EQ(grows[0].at(7), "2");
    EXPECT_EQ(grows[1].at(7), "5");
    EXPECT_EQ(grows[2].at(7), "2");
    EXPECT_EQ(grows[0].at(5), "41234");
    EXPECT_NE(grows[0].at(6), *tokens.begin());
    EXPECT_NE(grows[0].at(8), *run_ids.begin());

    // Inside an allocation (CUDA_VISIBLE_DEVICES inherited) --gpus indices count within it; a UUID passes as it is;
    // an index past it is refused.
    Result a = run({"-n", "3", "--gpus", "1,3,GPU-5e1f", "--", "sh", "-c", script}, {"CUDA_VISIBLE_DEVICES=4,5,6,7"});
    ASSERT_EQ(a.exit_code, 0) << a.err;
    auto arows = parse(a, 3);
    EXPECT_EQ(arows[0].at(7), "5");
    EXPECT_EQ(arows[1].at(7), "7");
    EXPECT_EQ(arows[2].at(7), "GPU-5e1f");
    Result past = run({"-n", "2", "--gpus", "0,4", "--", "true"}, {"CUDA_VISIBLE_DEVICES=4,5,6,7"});
    EXPECT_NE(past.exit_code, 0);
    EXPECT_TRUE(contains(past.err, "has 4 devices; --gpus indices count within it")) << past.err;
}

TEST_F(WeftrunTest, RoutesStdoutAndStderrAndFlushesPartialLines) {
    Result r = run({"-n", "2", "--", "sh", "-c", "printf 'out1\\nout2-partial'; printf 'err1\\n' >&2"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    for (int k = 0; k < 2; ++k) {
        std::string p = "[rank " + std::to_string(k) + "] ";
        EXPECT_TRUE(contains(r.out, p + "out1\n")) << r.out;
        EXPECT_TRUE(contains(r.out, p + "out2-partial\n")) << r.out;
        EXPECT_TRUE(contains(r.err, p + "err1\n")) << r.err;
        EXPECT_FALSE(contains(r.out, "err1"));
    }
    EXPECT_EQ(lines(r.out).size(), 4u);
}

TEST_F(WeftrunTest, SplitsOverlongLines) {
    Result r = run({"-n", "1", "--", "sh", "-c", "head -c 100000 /dev/zero | tr '\\0' a; echo; echo next"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::vector<std::string> got = lines(r.out);
    ASSERT_EQ(got.size(), 3u);
    EXPECT_EQ(got[0], "[rank 0] " + std::string(65536, 'a'));
    EXPECT_EQ(got[1], "[rank 0] " + std::string(100000 - 65536, 'a'));
    EXPECT_EQ(got[2], "[rank 0] next");
}

TEST_F(WeftrunTest, ExitCodeOfTheFailingRank) {
    Result r = run({"-n", "3", "--", "sh", "-c", "sleep 0.$RANK; [ $RANK = 2 ] && exit 5; exit 0"});
    EXPECT_EQ(r.exit_code, 5);
    EXPECT_TRUE(contains(r.err, "rank 2 failed first: exited with code 5")) << r.err;
    // Ranks that finish early with 0 do not stop the others.
    Result ok = run({"-n", "2", "--", "sh", "-c", "[ $RANK = 0 ] && exit 0; sleep 0.3; echo late"});
    EXPECT_EQ(ok.exit_code, 0) << ok.err;
    EXPECT_TRUE(contains(ok.out, "[rank 1] late")) << ok.out;
}

TEST_F(WeftrunTest, FailingRankStopsTheOthersQuickly) {
    Result r = run({"-n", "3", "--", "sh", "-c", "if [ $RANK = 1 ]; then sleep 0.2; exit 3; fi; sleep 30"});
    EXPECT_EQ(r.exit_code, 3);
    EXPECT_LT(r.seconds, 5.0);
    EXPECT_TRUE(contains(r.err, "rank 1 exited with code 3; stopping the other ranks")) << r.err;
    EXPECT_TRUE(contains(r.err, "rank 1 failed first")) << r.err;
}

TEST_F(WeftrunTest, RankKilledBySignal) {
    Result r = run({"-n", "2", "--", "sh", "-c", "if [ $RANK = 0 ]; then kill -SEGV $$; fi; sleep 30"});
    EXPECT_EQ(r.exit_code, 128 + SIGSEGV);
    EXPECT_LT(r.seconds, 5.0);
    EXPECT_TRUE(contains(r.err, "rank 0 failed first: was killed by SIGSEGV")) << r.err;
}

TEST_F(WeftrunTest, TimeoutStopsEveryRank) {
    Result r = run({"-n", "2", "--timeout", "0.4", "--", "sleep", "30"});
    EXPECT_EQ(r.exit_code, 124);
    EXPECT_GE(r.seconds, 0.39);
    EXPECT_LT(r.seconds, 5.0);
    EXPECT_TRUE(contains(r.err, "timed out after 0.4 s") && contains(r.err, "ranks still running: 0, 1")) << r.err;
}

TEST_F(WeftrunTest, RanksIgnoringSigtermAreKilledAfterTheGracePeriod) {
    Result r = run({"-n", "2", "--timeout", "0.3", "--grace", "0.3", "--", "sh", "-c", "trap '' TERM; sleep 30"});
    EXPECT_EQ(r.exit_code, 124);
    EXPECT_GE(r.seconds, 0.59);
    EXPECT_LT(r.seconds, 5.0);
}

TEST_F(WeftrunTest, ForwardsSigtermAndSigint) {
    for (int sig : {SIGTERM, SIGINT}) {
        std::string name = sig == SIGTERM ? "TERM" : "INT";
        std::string script = "trap 'echo got-" + name + "-$RANK; exit 7' " + name +
                             "; echo ready; while :; do sleep 0.05; done";
        Weftrun w({"-n", "2", "--", "sh", "-c", script});
        ASSERT_TRUE(w.wait_for_stdout("ready", 2, milliseconds(10000)));
        w.send_signal(sig);
        Result r = w.finish();
        EXPECT_EQ(r.exit_code, 128 + sig) << r.err;
        EXPECT_TRUE(contains(r.out, "[rank 0] got-" + name + "-0")) << r.out;
        EXPECT_TRUE(contains(r.out, "[rank 1] got-" + name + "-1")) << r.out;
        EXPECT_TRUE(contains(r.err, "received SIG" + name)) << r.err;
        EXPECT_LT(r.seconds, 10.0);
    }
}

/// Whether `pid` is gone (or a zombie nobody reaped yet: it runs no more).
bool process_gone(pid_t pid) {
    if (::kill(pid, 0) != 0) return errno == ESRCH;
    FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
    if (f == nullptr) return true;
    char state = 0;
    const int got = std::fscanf(f, "%*d (%*[^)]) %c", &state);
    std::fclose(f);
    return got == 1 && (state == 'Z' || state == 'X');
}

// A failed job leaves nothing behind: rank 0 left a helper that ignores SIGTERM and holds its output pipe; rank 1
// fails. The helper goes with weftrun's final SIGKILL of every rank's process group, not 30 s later.
TEST_F(WeftrunTest, AFailedJobLeavesNoProcessBehind) {
    char dir_template[] = "/tmp/weftrun_leftover_XXXXXX";
    ASSERT_NE(::mkdtemp(dir_template), nullptr);
    const std::string pid_file = std::string(dir_template) + "/helper.pid";
    const std::string script =
        "if [ $RANK = 1 ]; then sleep 0.5; exit 3; fi; (trap '' TERM; exec sleep 30) & echo $! > " + pid_file +
        "; wait";
    Result r = run({"-n", "2", "--", "sh", "-c", script});
    EXPECT_EQ(r.exit_code, 3) << r.err;
    FILE* f = std::fopen(pid_file.c_str(), "r");
    ASSERT_NE(f, nullptr) << "rank 0 never started its helper";
    int helper = 0;
    ASSERT_EQ(std::fscanf(f, "%d", &helper), 1);
    std::fclose(f);
    const auto deadline = Clock::now() + milliseconds(3000);
    while (!process_gone(helper) && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(10));
    EXPECT_TRUE(process_gone(helper)) << "rank 0's helper (pid " << helper << ") outlived the failed job";
    if (!process_gone(helper)) ::kill(helper, SIGKILL);
    std::remove(pid_file.c_str());
    ::rmdir(dir_template);
}

// A reader that stops reading weftrun's stdout (a pager left unscrolled) does not stop weftrun from acting: the
// timeout still kills the ranks, which write without end; their output is written once the reader reads again.
TEST_F(WeftrunTest, AStalledReaderDoesNotHoldUpTheTimeout) {
    char dir_template[] = "/tmp/weftrun_stalled_XXXXXX";
    ASSERT_NE(::mkdtemp(dir_template), nullptr);
    const std::string dir = dir_template;
    Weftrun w({"-n", "2", "--timeout", "0.5", "--", "sh", "-c", "echo $$ > " + dir + "/$RANK.pid; exec yes stalled"});
    std::this_thread::sleep_for(milliseconds(3000));  // nothing read meanwhile: weftrun's stdout pipe is full
    for (int rank = 0; rank < 2; ++rank) {
        const std::string file = dir + "/" + std::to_string(rank) + ".pid";
        FILE* f = std::fopen(file.c_str(), "r");
        ASSERT_NE(f, nullptr) << "rank " << rank << " never started";
        int pid = 0;
        ASSERT_EQ(std::fscanf(f, "%d", &pid), 1);
        std::fclose(f);
        EXPECT_TRUE(process_gone(pid)) << "rank " << rank << " (pid " << pid
                                       << ") still runs 2.5 s after the timeout while stdout was not read";
        if (!process_gone(pid)) ::kill(pid, SIGKILL);
        std::remove(file.c_str());
    }
    ::rmdir(dir_template);
    Result r = w.finish();
    EXPECT_EQ(r.exit_code, 124) << r.err;
    EXPECT_TRUE(contains(r.out, "[rank 0] stalled") && contains(r.out, "[rank 1] stalled"));
    EXPECT_TRUE(contains(r.err, "timed out after 0.5 s")) << r.err;
}

/// CPU time (user + system, in clock ticks) process `pid` has used so far; -1 when unreadable.
long cpu_ticks(pid_t pid) {
    FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
    if (f == nullptr) return -1;
    long utime = 0, stime = 0;
    const int got = std::fscanf(f, "%*d (%*[^)]) %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %ld %ld", &utime, &stime);
    std::fclose(f);
    return got == 2 ? utime + stime : -1;
}

// A rank that wrote more than the reader took and exited before --timeout passed: weftrun waits for the reader without
// spinning (a deadline past and not acted on made every poll return at once), then exits 0.
TEST_F(WeftrunTest, WaitingForAStalledReaderDoesNotSpin) {
    Weftrun w({"-n", "1", "--timeout", "1", "--", "sh", "-c", "head -c 4230000 /dev/zero | tr '\\0' a; echo"});
    std::this_thread::sleep_for(milliseconds(1500));
    const long before = cpu_ticks(w.pid());
    std::this_thread::sleep_for(milliseconds(2000));  // nothing read: weftrun holds a backlog past the timeout
    const long after = cpu_ticks(w.pid());
    ASSERT_GE(before, 0);
    ASSERT_GE(after, 0);
    const long hz = ::sysconf(_SC_CLK_TCK);
    EXPECT_LT(after - before, hz / 2) << "weftrun used " << after - before << " ticks of CPU in 2 s while waiting";
    Result r = w.finish();
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_GT(r.out.size(), 4230000u);
}

// With a reader that takes nothing, a second SIGINT ends weftrun (by SIGINT) instead of waiting for the reader.
TEST_F(WeftrunTest, ASecondSignalEndsWeftrunDespiteAStalledReader) {
    Weftrun w({"-n", "1", "--", "sh", "-c", "head -c 4400000 /dev/zero | tr '\\0' a; echo; sleep 30"});
    std::this_thread::sleep_for(milliseconds(1000));
    w.send_signal(SIGINT);
    std::this_thread::sleep_for(milliseconds(300));
    w.send_signal(SIGINT);
    std::this_thread::sleep_for(milliseconds(2500));  // still nothing read: it gives up on the output after 1 s
    const auto start = Clock::now();
    Result r = w.finish(milliseconds(20000));
    EXPECT_EQ(r.exit_code, -SIGINT) << r.err;
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0) << "weftrun waited for its reader";
}

// A rank's last lines come before the message about its exit, also when its pipes were not being read (the reader
// was behind) when it exited.
TEST_F(WeftrunTest, ARanksLastLinesPrecedeItsExitMessageBehindASlowReader) {
    Weftrun w(
        {"-n", "1", "--", "sh", "-c", "head -c 4230000 /dev/zero | tr '\\0' a; echo; echo last-words >&2; exit 3"});
    std::this_thread::sleep_for(milliseconds(1500));
    Result r = w.finish();
    EXPECT_EQ(r.exit_code, 3) << r.err;
    const size_t words = r.err.find("[rank 0] last-words"), exit_message = r.err.find("rank 0 exited with code 3");
    ASSERT_NE(words, std::string::npos) << r.err;
    ASSERT_NE(exit_message, std::string::npos) << r.err;
    EXPECT_LT(words, exit_message) << r.err;
}

// Under nohup (SIGHUP ignored when weftrun starts) a hangup neither stops weftrun nor reaches the ranks.
TEST_F(WeftrunTest, ASignalIgnoredAtStartStaysIgnored) {
    Weftrun w({"-n", "2", "--", "sh", "-c", "echo ready; sleep 1; echo done-$RANK"}, {}, {SIGHUP});
    ASSERT_TRUE(w.wait_for_stdout("ready", 2, milliseconds(10000)));
    w.send_signal(SIGHUP);
    Result r = w.finish();
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(contains(r.out, "[rank 0] done-0") && contains(r.out, "[rank 1] done-1")) << r.out;
    EXPECT_FALSE(contains(r.err, "received SIGHUP")) << r.err;
}

// weftrun run inside another launcher's worker (torchrun) does not pass that launcher's variables on: the ranks
// would take its job for theirs.
TEST_F(WeftrunTest, AnotherLaunchersVariablesAreNotPassedOn) {
    Result r =
        run({"-n", "1", "--", "sh", "-c", "echo ${TORCHELASTIC_RUN_ID-unset} ${GROUP_RANK-unset} ${ROLE_RANK-unset}"},
            {"TORCHELASTIC_RUN_ID=outer", "GROUP_RANK=3", "ROLE_RANK=1"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(lines(r.out), (std::vector<std::string>{"[rank 0] unset unset unset"})) << r.out;
}

TEST_F(WeftrunTest, MissingProgram) {
    Result r = run({"-n", "2", "--", "/nonexistent/weft-test-program"});
    EXPECT_EQ(r.exit_code, 127);
    EXPECT_TRUE(contains(r.err, "cannot execute '/nonexistent/weft-test-program'")) << r.err;
    EXPECT_TRUE(contains(r.err, "failed first")) << r.err;
}

// ---- end to end: processes under weftrun meet through the TCP store ---------------------------------

constexpr const char* kChildFlag = "WEFT_TEST_WEFTRUN_CHILD";

weft::Bytes rank_blob(int rank) {
    weft::Bytes b(static_cast<size_t>(100 + 37 * rank));
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(rank * 31 + static_cast<int>(i));
    return b;
}

// Runs only as a rank started by WeftrunTest.ProcessesMeetThroughTheRendezvousStore (it re-runs this binary).
TEST(WeftrunChild, RendezvousAcrossProcesses) {
    if (std::getenv(kChildFlag) == nullptr) GTEST_SKIP() << "runs only as a rank under weftrun";
    auto env = weft::detect_launch_env();
    ASSERT_TRUE(env.has_value());
    EXPECT_EQ(env->launcher, "weftrun");
    EXPECT_EQ(env->job_token.size(), 64u);
    const int rank = env->rank, n = env->num_ranks;
    const milliseconds timeout(20000);
    weft::RendezvousOptions o;
    o.host = env->master_addr;
    o.port = env->master_port;
    o.rank = rank;
    o.num_ranks = n;
    o.token = env->job_token;
    o.timeout = timeout;
    if (rank == 0) std::this_thread::sleep_for(milliseconds(100));  // the others connect first and retry
    auto store = weft::make_tcp_store(o);
    std::this_thread::sleep_for(milliseconds(10 * rank));
    store->add("e2e/arrived", 1);
    store->barrier("e2e/b0", rank, n, timeout);
    const std::string n_text = std::to_string(n);
    EXPECT_EQ(store->get("e2e/arrived", milliseconds(0)), weft::Bytes(n_text.begin(), n_text.end()));
    auto blobs = store->all_gather("e2e/ag", rank, n, rank_blob(rank), timeout);
    ASSERT_EQ(blobs.size(), static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) EXPECT_EQ(blobs[static_cast<size_t>(r)], rank_blob(r)) << "blob of rank " << r;
    store->barrier("e2e/b1", rank, n, timeout);
    // Rank 0 hosts the server: it leaves only after every other rank is done with the store.
    if (rank != 0) {
        if (store->add("e2e/out", 1) == n - 1) store->set("e2e/all_out", {});
    } else if (n > 1) {
        store->get("e2e/all_out", timeout);
    }
    std::printf("rank %d of %d: rendezvous ok\n", rank, n);
}

std::string self_path() {
    char buf[PATH_MAX];
    ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

TEST_F(WeftrunTest, ProcessesMeetThroughTheRendezvousStore) {
    std::string self = self_path();
    ASSERT_FALSE(self.empty());
    for (int n : {1, 2, 3, 5}) {
        Result r = run({"-n", std::to_string(n), "--timeout", "60", "--", self,
                        "--gtest_filter=WeftrunChild.RendezvousAcrossProcesses"},
                       {std::string(kChildFlag) + "=1"});
        EXPECT_EQ(r.exit_code, 0) << "n=" << n << "\n" << r.out << r.err;
        for (int k = 0; k < n; ++k) {
            std::string ok = "[rank " + std::to_string(k) + "] rank " + std::to_string(k) + " of " +
                             std::to_string(n) + ": rendezvous ok";
            EXPECT_TRUE(contains(r.out, ok)) << "n=" << n << ": no '" << ok << "' in\n" << r.out << r.err;
        }
    }
}

TEST_F(WeftrunTest, UsageErrors) {
    struct Case {
        std::vector<std::string> args;
        const char* message;
    };
    std::vector<Case> cases = {
        {{}, "-n N (the number of ranks) is required"},
        {{"-n", "0", "--", "true"}, "-n must be an integer in [1, 4096], got '0'"},
        {{"-n", "two", "--", "true"}, "got 'two'"},
        {{"-n", "2"}, "no program given"},
        {{"-n", "2", "--"}, "no program given"},
        {{"-n"}, "-n needs a value"},
        {{"-n", "2", "--gpus", "0,,1", "--", "true"}, "--gpus must be a comma-separated list"},
        {{"-n", "2", "--gpus", "--", "true"}, "--gpus must be a comma-separated list"},
        {{"-n", "2", "--timeout", "-1", "--", "true"}, "--timeout must be a number of seconds"},
        {{"-n", "2", "--port", "70000", "--", "true"}, "--port must be an integer in [1, 65535]"},
        {{"-n", "2", "--frobnicate", "--", "true"}, "unknown option '--frobnicate'"},
    };
    for (const Case& c : cases) {
        Result r = run(c.args);
        EXPECT_EQ(r.exit_code, 2) << c.message;
        EXPECT_TRUE(contains(r.err, c.message)) << r.err;
        EXPECT_TRUE(contains(r.err, "usage: weftrun")) << r.err;
    }
    Result help = run({"--help"});
    EXPECT_EQ(help.exit_code, 0);
    EXPECT_TRUE(contains(help.out, "--timeout")) << help.out;
    // Both spellings of the options work, and the program may follow the options without "--".
    Result r = run({"-n3", "--timeout=20", "sh", "-c", "echo $WORLD_SIZE"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(lines(r.out).size(), 3u);
    EXPECT_TRUE(contains(r.out, "] 3")) << r.out;
}

}  // namespace
