// SPDX-License-Identifier: MIT
// Reading NVTX recorder files and running a test in a child process under the recorder.
#include "support/nvtx_record.hpp"

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

extern char** environ;

namespace weft::testing {

std::vector<NvtxEvent> read_nvtx_record(const std::filesystem::path& path) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("no NVTX record at " + path.string());
    std::vector<NvtxEvent> events;
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
        std::istringstream is(line);
        NvtxEvent e;
        bool ok = static_cast<bool>(is >> e.thread >> e.kind >> e.domain);
        if (ok && (e.kind == "push" || e.kind == "mark")) {
            ok = is.get() == ' ';
            std::getline(is, e.message);  // the rest of the line: a message may hold spaces
        } else if (ok) {
            ok = e.kind == "pop" && (is >> std::ws).eof();
        }
        if (!ok) {
            const std::string expected = "'<thread> push|mark <domain> <message>' or '<thread> pop <domain>'";
            throw std::runtime_error(path.string() + ":" + std::to_string(number) + ": expected " + expected +
                                     ", got '" + line + "'");
        }
        events.push_back(std::move(e));
    }
    return events;
}

NvtxRanges nvtx_ranges(const std::vector<NvtxEvent>& events, const std::string& domain) {
    NvtxRanges r;
    std::map<int, std::vector<std::string>> open;  // thread -> messages of its open ranges, outermost first
    auto path_of = [](const std::vector<std::string>& stack, const std::string& last) {
        std::string p;
        for (const std::string& s : stack) p += s + " > ";
        return p + last;
    };
    for (const NvtxEvent& e : events) {
        if (e.domain != domain) continue;
        std::vector<std::string>& stack = open[e.thread];
        if (e.kind == "pop") {
            if (stack.empty() && r.problem.empty()) {
                r.problem = "thread " + std::to_string(e.thread) + " pops a " + domain + " range it never pushed";
            }
            if (!stack.empty()) stack.pop_back();
            continue;
        }
        r.seen.push_back({e.thread, e.kind, path_of(stack, e.message)});
        if (e.kind == "push") stack.push_back(e.message);
    }
    for (const auto& [thread, stack] : open) {
        if (!stack.empty() && r.problem.empty()) {
            r.problem = "thread " + std::to_string(thread) + " leaves " + domain + " range '" +
                        path_of({stack.begin(), stack.end() - 1}, stack.back()) + "' open";
        }
    }
    return r;
}

int NvtxRanges::count(int thread, const std::string& kind, const std::string& path) const {
    return static_cast<int>(std::count_if(seen.begin(), seen.end(), [&](const NvtxSeen& s) {
        return s.thread == thread && s.kind == kind && s.path == path;
    }));
}

bool NvtxRanges::has(int thread, const std::string& kind, const std::string& path) const {
    return count(thread, kind, path) > 0;
}

const char* nvtx_recorder_path() {
    // WEFT_NVTX_RECORDER: the library elsewhere (test binaries copied to another machine without their build tree).
    const char* moved = std::getenv("WEFT_NVTX_RECORDER");
    return moved != nullptr && *moved != '\0' ? moved : WEFT_NVTX_RECORDER_PATH;
}

ChildRun run_self_under_nvtx_recorder(const std::string& test_name, const std::filesystem::path& record,
                                      const std::string& child_flag, std::chrono::milliseconds limit) {
    ChildRun run;
    char self[PATH_MAX];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) throw std::runtime_error("cannot read /proc/self/exe");
    self[n] = '\0';
    // The child's environment: this one without a previous injection, record or XML report (the parent's own).
    std::vector<std::string> env_s;
    for (char** p = environ; *p != nullptr; ++p) {
        const std::string e(*p);
        const std::string name = e.substr(0, e.find('='));
        if (name == "NVTX_INJECTION64_PATH" || name == "WEFT_NVTX_RECORD" || name == child_flag ||
            name == "GTEST_OUTPUT") {
            continue;
        }
        env_s.push_back(e);
    }
    env_s.push_back(std::string("NVTX_INJECTION64_PATH=") + nvtx_recorder_path());
    env_s.push_back("WEFT_NVTX_RECORD=" + record.string());
    env_s.push_back(child_flag + "=1");
    std::vector<std::string> args = {self, "--gtest_filter=" + test_name};
    std::vector<char*> argv, envp;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (std::string& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);

    const std::filesystem::path output_path = record.string() + ".output";
    const int out = ::open(output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (out < 0) throw std::runtime_error("cannot write " + output_path.string());
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out, 1);
    posix_spawn_file_actions_adddup2(&actions, out, 2);
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, self, &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    ::close(out);
    if (rc != 0) {
        throw std::runtime_error("cannot start " + std::string(self) + ": posix_spawn error " + std::to_string(rc));
    }

    int status = 0;
    std::string ending;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
        if (::waitpid(pid, &status, WNOHANG) == pid) {
            run.exited_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
            ending = WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                                       : "killed by signal " + std::to_string(WTERMSIG(status));
            break;
        }
        if (std::chrono::steady_clock::now() > deadline) {
            ::kill(pid, SIGKILL);
            ::waitpid(pid, &status, 0);
            ending = "killed after " + std::to_string(limit.count()) + " ms";
            break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::ifstream in(output_path);
    std::ostringstream os;
    os << in.rdbuf();
    run.output = os.str() + "[child " + test_name + ": " + ending + "]\n";
    return run;
}

}  // namespace weft::testing
