// SPDX-License-Identifier: MIT
// weftrun: starts N ranks of a program on this host, prefixes their output and stops them all on failure.
//
//   weftrun -n N [--gpus LIST] [--timeout S] [--port P] [--grace S] [--] prog args...
//
// Each rank is a child process in its own process group (so a stop reaches its children too) with RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT, WEFT_RUN_ID (names the job:
// its ranks meet at a store named after it), WEFT_JOB_TOKEN and, with --gpus, CUDA_VISIBLE_DEVICES set.
// stdin is /dev/null. Every line a rank writes to stdout / stderr is copied to weftrun's stdout / stderr
// prefixed with "[rank K] ". One poll() loop: child pipes, a signalfd for SIGCHLD / SIGINT / SIGTERM / SIGHUP,
// and the deadlines; a second thread only writes weftrun's output (see Output).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "options.hpp"

extern char** environ;  // NOLINT: POSIX

using weft::weftrun::Options;
using weft::weftrun::parse_args;

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxLineBytes = 64 * 1024;  // longer lines are split (each piece prefixed)
constexpr int kTimeoutExit = 124;
constexpr int kStartExit = 1;  // a rank weftrun could not start (pipe, fork, /dev/null)
// How long ranks may take to exit after SIGKILL before weftrun names them and leaves (a GPU context teardown stuck in
// the driver).
constexpr std::chrono::seconds kAfterKill{10};
// Output queued for a reader that does not keep up (a pager left unscrolled) beyond which the ranks' pipes are read
// no further until it drains: the ranks then block on their own writes, as they would writing to that reader.
constexpr size_t kMaxBacklog = 4 << 20;
constexpr int kBacklogPollMs = 20;  // how often the loop looks whether such a backlog has drained
// After the last rank exits, how long its pipes are still read (a background process it left may hold them open).
constexpr std::chrono::seconds kDrainWindow{1};

/// A port that was free a moment ago on 127.0.0.1 (the kernel picks it; rank 0 binds it again shortly).
int pick_free_port() {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return 0;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    int port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
        port = ntohs(addr.sin_port);
    }
    ::close(fd);
    return port;
}

/// 32 random bytes from /dev/urandom as 64 hex digits; empty on failure.
std::string random_token() {
    int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return {};
    unsigned char bytes[32];
    size_t got = 0;
    while (got < sizeof(bytes)) {
        ssize_t n = ::read(fd, bytes + got, sizeof(bytes) - got);
        if (n <= 0) {
            if (n < 0 && errno == EINTR) continue;
            break;
        }
        got += static_cast<size_t>(n);
    }
    ::close(fd);
    if (got != sizeof(bytes)) return {};
    static const char* kHex = "0123456789abcdef";
    std::string token;
    for (unsigned char b : bytes) {
        token += kHex[b >> 4];
        token += kHex[b & 15];
    }
    return token;
}

std::string signal_name(int sig) {
    const char* abbrev = sigabbrev_np(sig);
    return abbrev != nullptr ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

/// Writes everything, retrying on EINTR; gives up on that fd (silently) after an error such as EPIPE.
void write_all(int fd, const std::string& text) {
    static bool broken[3] = {false, false, false};
    if (fd < 0 || fd > 2 || broken[fd]) return;
    size_t done = 0;
    while (done < text.size()) {
        ssize_t n = ::write(fd, text.data() + done, text.size() - done);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {  // a non-blocking description someone else set: wait until it takes more
                pollfd p{fd, POLLOUT, 0};
                ::poll(&p, 1, 100);
                continue;
            }
            broken[fd] = true;
            return;
        }
        done += static_cast<size_t>(n);
    }
}

/// weftrun's stdout and stderr. The event loop queues text; a thread of its own writes it, in the order queued, with
/// ordinary blocking writes (the terminal's file description is shared with the shell: it stays blocking). A reader
/// that stops reading blocks only that thread: the loop goes on acting on timeouts, signals and exits. Made once and
/// never destroyed (its thread may be blocked in a write when the process exits).
class Output {
public:
    static Output& get() {
        static Output* output = new Output();  // NOLINT: deliberately never freed (see above)
        return *output;
    }

    void write(int fd, std::string text) {
        if (text.empty()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        backlog_ += text.size();
        queue_.emplace_back(fd, std::move(text));
        ready_.notify_all();
    }

    /// Bytes queued and not yet written.
    size_t backlog() {
        std::lock_guard<std::mutex> lock(mutex_);
        return backlog_;
    }

    /// Waits until everything queued is written.
    void drain() {
        std::unique_lock<std::mutex> lock(mutex_);
        drained_.wait(lock, [&] { return backlog_ == 0; });
    }

    /// Waits at most `limit` for everything queued to be written; true when it was.
    bool drain_for(Clock::duration limit) {
        std::unique_lock<std::mutex> lock(mutex_);
        return drained_.wait_for(lock, limit, [&] { return backlog_ == 0; });
    }

private:
    Output() {
        // The writer takes no signal: the loop's signalfd must see SIGINT / SIGTERM / SIGHUP / SIGCHLD even when
        // this thread starts before they are blocked.
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        try {
            std::thread([this] { run(); }).detach();
        } catch (...) {
            pthread_sigmask(SIG_SETMASK, &old, nullptr);
            throw;
        }
        pthread_sigmask(SIG_SETMASK, &old, nullptr);
    }

    void run() {
        std::unique_lock<std::mutex> lock(mutex_);
        for (;;) {
            ready_.wait(lock, [&] { return !queue_.empty(); });
            auto [fd, text] = std::move(queue_.front());
            queue_.pop_front();
            lock.unlock();
            write_all(fd, text);
            lock.lock();
            backlog_ -= text.size();
            if (backlog_ == 0) drained_.notify_all();
        }
    }

    std::mutex mutex_;
    std::condition_variable ready_, drained_;
    std::deque<std::pair<int, std::string>> queue_;
    size_t backlog_ = 0;
};

void say(const std::string& message) { Output::get().write(2, "weftrun: " + message + "\n"); }

struct Stream {
    int fd = -1;
    int rank = 0;
    int out_fd = 1;  // weftrun's stdout or stderr
    std::string partial;
};

struct Rank {
    pid_t pid = -1;
    bool running = false;
    int status = 0;
    bool live_at_failure = false;  // running, or its output pipes open, when the job's first failure was recorded
};

enum class FailureKind { kNone, kStart, kExit, kSignal, kTimeout, kInterrupted };

struct Failure {
    FailureKind kind = FailureKind::kNone;
    int rank = -1;
    int code = 0;             // exit code or signal number
    std::string description;  // filled when recorded
};

class Launcher {
public:
    explicit Launcher(Options options) : o_(std::move(options)) {}

    int run() {
        if (o_.port == 0) o_.port = pick_free_port();
        if (o_.port == 0) return fatal("cannot find a free TCP port on 127.0.0.1 (use --port)");
        token_ = random_token();
        if (token_.empty()) return fatal("cannot read /dev/urandom for the job token");
        run_id_ = random_token().substr(0, 32);  // its own draw: the run id is public, the token is not
        if (run_id_.empty()) return fatal("cannot read /dev/urandom for the run id");

        // Two pipes per rank stay open here: the soft open-file limit goes up to the hard one, and a job that still
        // would not fit is refused now, not at the rank whose pipe fails.
        rlimit files{};
        if (::getrlimit(RLIMIT_NOFILE, &files) == 0) {
            files_limit_ = files;  // the ranks get the limit weftrun was started with
            if (files.rlim_cur < files.rlim_max) {
                files.rlim_cur = files.rlim_max;
                (void)::setrlimit(RLIMIT_NOFILE, &files);
                (void)::getrlimit(RLIMIT_NOFILE, &files);
            }
            const auto needed = static_cast<rlim_t>(2 * o_.num_ranks + 32);
            if (files.rlim_cur != RLIM_INFINITY && files.rlim_cur < needed) {
                return fatal("-n " + std::to_string(o_.num_ranks) + " needs about " + std::to_string(needed) +
                             " open files; the limit is " + std::to_string(files.rlim_cur) + " (ulimit -n)");
            }
        }
        // A signal this process was started with ignored (nohup's SIGHUP, a background job's SIGINT) stays ignored:
        // a blocked signal would reach the signalfd even so.
        sigset_t mask;
        sigemptyset(&mask);
        sigaddset(&mask, SIGCHLD);
        for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
            struct sigaction current {};
            if (::sigaction(sig, nullptr, &current) == 0 && current.sa_handler == SIG_IGN) {
                ignored_.push_back(sig);
            } else {
                sigaddset(&mask, sig);
            }
        }
        if (sigprocmask(SIG_BLOCK, &mask, &old_mask_) != 0) return fatal("sigprocmask failed");
        signals_blocked_ = true;
        signal_fd_ = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
        if (signal_fd_ < 0) return fatal(std::string("signalfd failed: ") + std::strerror(errno));
        ::signal(SIGPIPE, SIG_IGN);  // a closed stdout must not kill weftrun while ranks run

        start_ = Clock::now();
        ranks_.resize(static_cast<size_t>(o_.num_ranks));
        for (int r = 0; r < o_.num_ranks; ++r) {
            if (!spawn(r)) {
                fail(Failure{FailureKind::kStart, r, kStartExit, {}});
                break;
            }
        }
        loop();
        // A failed job leaves nothing behind: processes a rank started in its group (a rank that exited before the
        // stop, or a helper that ignored SIGTERM) get SIGKILL too. A group that is gone answers ESRCH.
        // Only the groups of ranks that were running, or had their pipes open, when the job failed: a rank that
        // had exited and was reaped long before may have an empty group whose number another group took since.
        if (failure_.kind != FailureKind::kNone) {
            for (const Rank& rank : ranks_) {
                if (rank.pid > 0 && rank.live_at_failure) ::kill(-rank.pid, SIGKILL);
            }
        }
        const int code = report();
        restore_signals();
        if (stop_reading_ && !Output::get().drain_for(std::chrono::seconds(1))) {
            // Stopped by a signal while a reader does not take what is left: end by that signal now.
            ::signal(last_signal_, SIG_DFL);
            ::raise(last_signal_);
        }
        return code;
    }

private:
    int fatal(const std::string& message) {
        say(message);
        restore_signals();
        return 1;
    }

    /// The ranks are gone: SIGINT / SIGTERM / SIGHUP act on weftrun itself again (while main waits for its output to
    /// be written, a reader that never reads must not keep it beyond a Ctrl-C).
    void restore_signals() {
        if (signals_blocked_) ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
        signals_blocked_ = false;
    }

    std::vector<std::string> child_env(int rank) const {
        std::vector<std::string> set = {
            "RANK=" + std::to_string(rank),
            "WORLD_SIZE=" + std::to_string(o_.num_ranks),
            "LOCAL_RANK=" + std::to_string(rank),
            "LOCAL_WORLD_SIZE=" + std::to_string(o_.num_ranks),
            "MASTER_ADDR=127.0.0.1",
            "MASTER_PORT=" + std::to_string(o_.port),
            "WEFT_RUN_ID=" + run_id_,
            "WEFT_JOB_TOKEN=" + token_,
        };
        if (!o_.gpus.empty()) {
            set.push_back("CUDA_VISIBLE_DEVICES=" + o_.gpus[static_cast<size_t>(rank) % o_.gpus.size()]);
        }
        // Another launcher's variables weftrun inherits (run inside a torchrun worker) would make the ranks take that
        // launcher's job for theirs.
        const auto foreign = [](const std::string& name) {
            return name.rfind("TORCHELASTIC_", 0) == 0 || name.rfind("ROLE_", 0) == 0 || name == "GROUP_RANK" ||
                   name == "GROUP_WORLD_SIZE";
        };
        std::vector<std::string> env;
        for (char** p = environ; p != nullptr && *p != nullptr; ++p) {
            std::string entry(*p);
            std::string name = entry.substr(0, entry.find('='));
            if (foreign(name)) continue;
            bool overridden = std::any_of(set.begin(), set.end(),
                                          [&](const std::string& s) { return s.compare(0, name.size() + 1, name + "=") == 0; });
            if (!overridden) env.push_back(std::move(entry));
        }
        env.insert(env.end(), set.begin(), set.end());
        return env;
    }

    bool spawn(int rank) {
        int out_pipe[2], err_pipe[2];
        if (::pipe2(out_pipe, O_CLOEXEC) != 0) return spawn_error(rank, "pipe");
        if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
            ::close(out_pipe[0]);
            ::close(out_pipe[1]);
            return spawn_error(rank, "pipe");
        }
        int dev_null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (dev_null < 0) {
            for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) ::close(fd);
            return spawn_error(rank, "open(/dev/null)");
        }
        // Everything the child needs is built before fork (after it only async-signal-safe calls are made).
        std::vector<std::string> env = child_env(rank);
        std::vector<char*> envp, argv;
        for (auto& e : env) envp.push_back(e.data());
        envp.push_back(nullptr);
        for (auto& a : o_.command) argv.push_back(a.data());
        argv.push_back(nullptr);
        std::string exec_error = "weftrun: cannot execute '" + o_.command[0] + "': ";
        pid_t parent = ::getpid();

        pid_t pid = ::fork();
        if (pid < 0) {
            for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1], dev_null}) ::close(fd);
            return spawn_error(rank, "fork");
        }
        if (pid == 0) {
            ::setpgid(0, 0);
            ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // weftrun killed outright: take the rank with it
            if (::getppid() != parent) ::_exit(126);
            for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGCHLD}) {
                const bool keep_ignored = std::find(ignored_.begin(), ignored_.end(), sig) != ignored_.end();
                ::signal(sig, keep_ignored ? SIG_IGN : SIG_DFL);
            }
            ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
            if (files_limit_) ::setrlimit(RLIMIT_NOFILE, &*files_limit_);
            ::dup2(dev_null, 0);
            ::dup2(out_pipe[1], 1);
            ::dup2(err_pipe[1], 2);
            ::execvpe(argv[0], argv.data(), envp.data());
            int err = errno;
            // strerrordesc_np: a table lookup (strerror may take the locale's locks, which another thread of the
            // parent, the output writer, could have held at fork).
            const char* why = ::strerrordesc_np(err);
            if (why == nullptr) why = "unknown error";
            ssize_t ignored = ::write(2, exec_error.data(), exec_error.size());
            ignored = ::write(2, why, std::strlen(why));
            ignored = ::write(2, "\n", 1);
            (void)ignored;
            ::_exit(err == ENOENT ? 127 : 126);
        }
        ::setpgid(pid, pid);  // also here, so the group exists before any signal is sent to it
        ::close(out_pipe[1]);
        ::close(err_pipe[1]);
        ::close(dev_null);
        for (int fd : {out_pipe[0], err_pipe[0]}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
        streams_.push_back(Stream{out_pipe[0], rank, 1, {}});
        streams_.push_back(Stream{err_pipe[0], rank, 2, {}});
        Rank& r = ranks_[static_cast<size_t>(rank)];
        r.pid = pid;
        r.running = true;
        ++running_;
        return true;
    }

    bool spawn_error(int rank, const char* call) {
        say("cannot start rank " + std::to_string(rank) + ": " + call + " failed: " + std::strerror(errno));
        return false;
    }

    // -- the event loop ----------------------------------------------------------------------------------

    void loop() {
        const std::optional<Clock::time_point> timeout_at =
            o_.timeout_s > 0 ? std::optional(start_ + std::chrono::duration_cast<Clock::duration>(
                                                          std::chrono::duration<double>(o_.timeout_s)))
                             : std::nullopt;
        Clock::time_point previous_round = Clock::now();
        while (running_ > 0 || open_streams() > 0) {
            Clock::time_point now = Clock::now();
            const Clock::duration since_previous_round = now - previous_round;
            previous_round = now;
            if (stop_reading_) {
                for (Stream& s : streams_) close_stream(s);  // a signal after the ranks are gone, or a second one
                if (running_ == 0) break;
            }
            if (timeout_at && now >= *timeout_at && failure_.kind == FailureKind::kNone && running_ > 0) {
                fail(Failure{FailureKind::kTimeout, -1, 0, {}});
            }
            if (kill_at_ && now >= *kill_at_) {
                kill_at_.reset();
                kill_all();
            }
            if (give_up_at_ && now >= *give_up_at_ && running_ > 0) {
                std::string still;
                for (size_t r = 0; r < ranks_.size(); ++r) {
                    if (ranks_[r].running) {
                        still += (still.empty() ? "" : ", ") + std::to_string(r) + " (pid " +
                                 std::to_string(ranks_[r].pid) + ")";
                    }
                }
                say("ranks " + still + " did not exit " + std::to_string(kAfterKill.count()) +
                    " s after SIGKILL (stuck in the kernel or the GPU driver); leaving them");
                gave_up_ = true;
                break;
            }
            if (running_ == 0 && !drain_until_) {
                // Every rank has exited; a background process it left may still hold a pipe open.
                drain_until_ = now + kDrainWindow;
            }
            if (drain_until_ && now >= *drain_until_) {
                for (Stream& s : streams_) close_stream(s);
                break;
            }

            std::optional<Clock::time_point> wake;
            auto consider = [&](const std::optional<Clock::time_point>& t) {
                if (t && (!wake || *t < *wake)) wake = t;
            };
            // Deadlines that act only on running ranks wake the loop only while ranks run (a deadline past and not
            // acted on would make every poll return at once).
            if (failure_.kind == FailureKind::kNone && running_ > 0) consider(timeout_at);
            consider(kill_at_);
            consider(drain_until_);
            if (running_ > 0) consider(give_up_at_);
            int wait_ms = -1;
            if (wake) {
                auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*wake - now).count() + 1;
                wait_ms = static_cast<int>(std::clamp<long long>(left, 0, 60000));
            }

            // A reader that does not keep up: the pipes wait (they fill, and the ranks block on their writes) while
            // signals and deadlines are still served; the drain window after the last exit is paused meanwhile (it
            // counts only time in which the pipes were read).
            const bool backlogged = Output::get().backlog() > kMaxBacklog;
            if (backlogged) {
                wait_ms = wait_ms < 0 ? kBacklogPollMs : std::min(wait_ms, kBacklogPollMs);
                if (drain_until_) *drain_until_ += since_previous_round;
            }
            std::vector<pollfd> fds;
            fds.push_back({signal_fd_, POLLIN, 0});
            std::vector<size_t> which;
            for (size_t i = 0; i < streams_.size() && !backlogged; ++i) {
                if (streams_[i].fd < 0) continue;
                fds.push_back({streams_[i].fd, POLLIN, 0});
                which.push_back(i);
            }
            int n = ::poll(fds.data(), fds.size(), wait_ms);
            if (n < 0) {
                if (errno == EINTR) continue;
                say(std::string("poll failed: ") + std::strerror(errno));
                kill_all();
                gave_up_ = true;
                break;
            }
            // Output first, so a rank's last lines print before the message about its exit.
            for (size_t k = 0; k < which.size(); ++k) {
                if (fds[k + 1].revents != 0) read_stream(streams_[which[k]]);
            }
            if (fds[0].revents != 0) handle_signals();
        }
        // Reap whatever is left (after the drain cut-off a rank cannot still be running, but be sure); not those
        // given up on.
        while (running_ > 0) {
            int status = 0;
            pid_t pid = ::waitpid(-1, &status, gave_up_ ? WNOHANG : 0);
            if (pid <= 0) break;  // none left, or (given up) only ranks still running
            on_exit(pid, status);
        }
    }

    size_t open_streams() const {
        return static_cast<size_t>(std::count_if(streams_.begin(), streams_.end(), [](const Stream& s) { return s.fd >= 0; }));
    }

    void read_stream(Stream& s) {
        char buf[16384];
        for (int i = 0; i < 64; ++i) {
            ssize_t n = ::read(s.fd, buf, sizeof(buf));
            if (n > 0) {
                s.partial.append(buf, static_cast<size_t>(n));
                emit_lines(s, false);
                continue;
            }
            if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
            close_stream(s);  // EOF (or an error: treat alike)
            return;
        }
    }

    void close_stream(Stream& s) {
        if (s.fd < 0) return;
        emit_lines(s, true);
        ::close(s.fd);
        s.fd = -1;
    }

    /// Writes the complete lines of `s.partial` with the rank prefix; with `flush`, the rest too.
    void emit_lines(Stream& s, bool flush) {
        std::string prefix = "[rank " + std::to_string(s.rank) + "] ";
        std::string out;
        size_t start = 0;
        while (start < s.partial.size()) {
            size_t nl = s.partial.find('\n', start);
            size_t end = nl;
            if (nl == std::string::npos) {
                size_t rest = s.partial.size() - start;
                if (!flush && rest < kMaxLineBytes) break;
                end = start + std::min(rest, kMaxLineBytes);
            } else if (nl - start > kMaxLineBytes) {
                end = start + kMaxLineBytes;
            }
            out += prefix;
            out.append(s.partial, start, end - start);
            out += '\n';
            start = (end == nl) ? nl + 1 : end;
        }
        s.partial.erase(0, start);
        Output::get().write(s.out_fd, std::move(out));
    }

    void handle_signals() {
        signalfd_siginfo info{};
        while (::read(signal_fd_, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
            int sig = static_cast<int>(info.ssi_signo);
            if (sig == SIGCHLD) {
                reap();
                continue;
            }
            ++signals_received_;
            last_signal_ = sig;
            if (running_ == 0 || signals_received_ > 1) {
                // The ranks are gone (their pipes may still wait for a reader that does not read) or this is the
                // second signal: weftrun stops reading their output and ends once no rank runs.
                stop_reading_ = true;
            }
            if (signals_received_ == 1) {
                if (failure_.kind == FailureKind::kNone) {
                    note_live_ranks(-1);
                    failure_ = Failure{FailureKind::kInterrupted, -1, sig, {}};
                    failure_.description = describe(failure_);
                }
                say("received " + signal_name(sig) + "; forwarding it to every rank");
                signal_ranks(sig);
                if (!kill_at_) kill_at_ = Clock::now() + grace();
            } else {
                say("received " + signal_name(sig) + " again; killing every rank");
                kill_all();
            }
        }
    }

    void reap() {
        while (running_ > 0) {
            int status = 0;
            pid_t pid = ::waitpid(-1, &status, WNOHANG);
            if (pid <= 0) return;
            on_exit(pid, status);
        }
    }

    void on_exit(pid_t pid, int status) {
        for (size_t r = 0; r < ranks_.size(); ++r) {
            Rank& rank = ranks_[r];
            if (rank.pid != pid || !rank.running) continue;
            rank.running = false;
            rank.status = status;
            --running_;
            // Its last lines before the message about its exit (the poll loop may not have read them: a reader
            // that does not keep up, or SIGCHLD first).
            for (Stream& st : streams_) {
                if (st.rank == static_cast<int>(r) && st.fd >= 0) read_stream(st);
            }
            if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
                fail(Failure{FailureKind::kExit, static_cast<int>(r), WEXITSTATUS(status), {}});
            } else if (WIFSIGNALED(status)) {
                fail(Failure{FailureKind::kSignal, static_cast<int>(r), WTERMSIG(status), {}});
            }
            return;
        }
    }

    Clock::duration grace() const {
        return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.grace_s));
    }

    /// Records the first failure and starts stopping the ranks; later failures are consequences.
    void fail(const Failure& f) {
        if (failure_.kind != FailureKind::kNone) return;
        note_live_ranks(f.rank);
        failure_ = f;
        failure_.description = describe(f);
        std::string who = f.rank >= 0 ? "rank " + std::to_string(f.rank) + " " : "";
        say(who + failure_.description + (running_ > 0 ? "; stopping the other ranks" : ""));
        signal_ranks(SIGTERM);
        if (!kill_at_) kill_at_ = Clock::now() + grace();
    }

    /// SIGKILL to every rank (signal_ranks), and the bound on how long they may take to go.
    void kill_all() {
        signal_ranks(SIGKILL);
        if (!give_up_at_) give_up_at_ = Clock::now() + kAfterKill;
    }

    /// Sends `sig` to the process group of every rank still running, and of every rank whose output
    /// pipes are still open (a process it started holds them).
    void signal_ranks(int sig) {
        for (size_t r = 0; r < ranks_.size(); ++r) {
            const Rank& rank = ranks_[r];
            if (rank.pid <= 0) continue;
            if (rank.running || rank_pipes_open(static_cast<int>(r))) ::kill(-rank.pid, sig);
        }
    }

    /// Marks the ranks whose process groups the final SIGKILL may reach: those running or with their pipes open now,
    /// and `failed` (a rank that just exited; its helpers may live on).
    void note_live_ranks(int failed) {
        for (size_t r = 0; r < ranks_.size(); ++r) {
            const int rank = static_cast<int>(r);
            ranks_[r].live_at_failure = ranks_[r].running || rank_pipes_open(rank) || rank == failed;
        }
    }

    bool rank_pipes_open(int rank) const {
        return std::any_of(streams_.begin(), streams_.end(),
                           [&](const Stream& s) { return s.rank == rank && s.fd >= 0; });
    }

    std::string describe(const Failure& f) const {
        switch (f.kind) {
            case FailureKind::kStart:
                return "could not be started (see the line above)";
            case FailureKind::kExit:
                return "exited with code " + std::to_string(f.code) + (f.code == 127 ? " (command not found?)" : "");
            case FailureKind::kSignal:
                return "was killed by " + signal_name(f.code) + " (signal " + std::to_string(f.code) + ")";
            case FailureKind::kTimeout: {
                std::string still;
                for (size_t r = 0; r < ranks_.size(); ++r) {
                    if (ranks_[r].running) still += (still.empty() ? "" : ", ") + std::to_string(r);
                }
                char secs[32];
                std::snprintf(secs, sizeof(secs), "%g", o_.timeout_s);
                return std::string("timed out after ") + secs + " s (--timeout); ranks still running: " + still;
            }
            case FailureKind::kInterrupted: return "interrupted by " + signal_name(f.code);
            case FailureKind::kNone: break;
        }
        return "ok";
    }

    int report() const {
        switch (failure_.kind) {
            case FailureKind::kNone: return 0;
            case FailureKind::kStart:
                say("job failed: rank " + std::to_string(failure_.rank) + " " + failure_.description);
                return kStartExit;
            case FailureKind::kExit:
                say("job failed: rank " + std::to_string(failure_.rank) + " failed first: " + failure_.description);
                return failure_.code;
            case FailureKind::kSignal:
                say("job failed: rank " + std::to_string(failure_.rank) + " failed first: " + failure_.description);
                return 128 + failure_.code;
            case FailureKind::kTimeout:
                say("job failed: " + failure_.description);
                return kTimeoutExit;
            case FailureKind::kInterrupted:
                say("job stopped: " + failure_.description);
                return 128 + failure_.code;
        }
        return 1;
    }

    Options o_;
    std::string token_;
    std::string run_id_;
    sigset_t old_mask_{};
    bool signals_blocked_ = false;
    int signal_fd_ = -1;
    Clock::time_point start_;
    std::vector<Rank> ranks_;
    std::vector<Stream> streams_;
    int running_ = 0;
    int signals_received_ = 0;
    int last_signal_ = 0;
    bool stop_reading_ = false;  // a signal after the ranks exited, or a second one: their pipes are read no further
    Failure failure_;
    std::optional<Clock::time_point> kill_at_;
    std::optional<Clock::time_point> drain_until_;
    std::optional<Clock::time_point> give_up_at_;  // kAfterKill after the first SIGKILL
    bool gave_up_ = false;                         // ranks left running after give_up_at_
    std::vector<int> ignored_;                     // SIGINT / SIGTERM / SIGHUP ignored when weftrun started
    std::optional<rlimit> files_limit_;            // RLIMIT_NOFILE when weftrun started (restored in the ranks)
};

}  // namespace

int main(int argc, char** argv) {
    Options options = parse_args(argc, argv);
    try {
        (void)Output::get();  // its thread starts before any signal is blocked or rank started
    } catch (const std::exception& e) {
        std::fprintf(stderr, "weftrun: cannot start its output thread: %s\n", e.what());
        return 1;
    }
    const int code = Launcher(std::move(options)).run();
    Output::get().drain();  // everything queued reaches the reader before weftrun exits
    return code;
}
