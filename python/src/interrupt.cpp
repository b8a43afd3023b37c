// SPDX-License-Identifier: MIT
// What the process's life does to the binding's calls: Python's signal handlers during a blocking call (Ctrl-C), and
// a fork after weft's objects were made.
#include <Python.h>
#include <pthread.h>

#include "binding.hpp"

#include <atomic>
#include <chrono>
#include <sstream>

#include "weft/runtime/store.hpp"

namespace weft::python {

namespace {

using Clock = std::chrono::steady_clock;

std::atomic<bool> forked{false};
// This process's id: set at load, and by the fork handler in a child.
std::atomic<pid_t> current_pid{::getpid()};
// Python's main thread, the only one that runs signal handlers (a forked child's is the thread that forked).
std::atomic<unsigned long> main_thread_ident{0};
// True while the main thread runs signal handlers from inside a weft wait (poll_signals_holding_gil). Only that thread
// sets it, so with its identity it tells "this thread is in such a handler"; a global atomic rather than a
// thread_local: the check runs on every call (Closable::Use), where a relaxed load costs nothing.
std::atomic<bool> handlers_running_in_wait{false};

// The least time between two runs of the signal handlers by one call's waits, and before the first: a call whose
// waits end sooner never takes the GIL for them.
constexpr std::chrono::milliseconds kMinSignalPollInterval{100};

// For the tests (wait_checks_on_main_thread, interrupts_taken).
std::atomic<int64_t> wait_checks{0};
std::atomic<int64_t> interrupts{0};

// This thread's interruptible calls.
struct InterruptState {
    int depth = 0;                          ///< calls in progress
    bool main_thread = false;               ///< the innermost one is on Python's main thread
    std::optional<nb::python_error> error;  ///< what interrupted it, until it has unwound
    std::string reason;                     ///< "KeyboardInterrupt" (and its message)
    Clock::time_point last_poll;            ///< when its waits last ran the handlers (or when it began)
};
thread_local InterruptState state;

// Where the innermost call keeps the outer one's state.
struct Saved {
    bool main_thread;
    std::optional<nb::python_error> error;
    std::string reason;
    Clock::time_point last_poll;
};
thread_local std::vector<Saved> saved;

bool on_main_thread() { return PyThread_get_thread_ident() == main_thread_ident.load(); }

std::string describe(const nb::python_error& e) {
    std::string text = Py_TYPE(e.value().ptr())->tp_name;
    try {
        const std::string message = nb::cast<std::string>(nb::str(e.value()));
        if (!message.empty()) text += ": " + message;
    } catch (...) {
    }
    return text;
}

// The runtime's wait check (weft::set_wait_interrupt_check), asked after a wait slice ran out: once the call was
// interrupted, every later wait of it ends at once (on any thread: a store's SystemExit on a worker thread too); on
// the main thread, at most every kMinSignalPollInterval, runs the pending signal handlers (with the GIL).
std::optional<std::string> check_wait() noexcept {
    InterruptState& s = state;
    if (s.depth == 0) return std::nullopt;
    if (s.error) return "interrupted by " + s.reason;
    if (!s.main_thread) return std::nullopt;
    wait_checks.fetch_add(1, std::memory_order_relaxed);
    // A handler's own call (World.abort) does not run handlers again inside it.
    if (handlers_running_in_wait.load(std::memory_order_relaxed)) return std::nullopt;
    const Clock::time_point now = Clock::now();
    if (now - s.last_poll < kMinSignalPollInterval) return std::nullopt;
    s.last_poll = now;
    if (!Py_IsInitialized() || interpreter_finalizing()) return std::nullopt;
    try {
        nb::gil_scoped_acquire gil;
        if (!poll_signals_holding_gil()) return std::nullopt;
    } catch (...) {
        return std::nullopt;
    }
    return "interrupted by " + s.reason;
}

}  // namespace

bool process_forked() { return forked.load(std::memory_order_relaxed); }

pid_t process_id() { return current_pid.load(std::memory_order_relaxed); }

void refuse_inside_signal_handler(const char* who) {
    if (!handlers_running_in_wait.load(std::memory_order_relaxed) || !on_main_thread()) return;
    throw Error(std::string("weft: a signal handler that runs inside a weft call on this thread called weft") +
                (who != nullptr ? std::string(" (") + who + ")" : std::string()) +
                ". Python runs a signal's handler while weft waits for other ranks, in the middle of that call, so "
                "only World.abort may be called there: raise an exception in the handler to interrupt the call, or "
                "set a flag and act on it after the call returns");
}

std::string forked_message(const char* who, pid_t made_in) {
    std::ostringstream os;
    os << who << ": this process was forked from process " << made_in << " after " << who
       << " was made there, and it (its World's rank, store connection and GPU context) is the parent's: a forked "
          "child cannot use it, nor CUDA. Start the child with multiprocessing's 'spawn' start method (or exec a new "
          "program) and call weft.init in it if it needs weft";
    return os.str();
}

void install_process_hooks() {
    main_thread_ident = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
    pthread_atfork(nullptr, nullptr, [] {  // async-signal-safe calls only
        current_pid.store(::getpid());
        forked.store(true);
        main_thread_ident.store(PyThread_get_thread_ident());
    });
    set_wait_interrupt_check(&check_wait);
}

InterruptScope::InterruptScope(FromSignalHandler from_handler) {
    if (from_handler == FromSignalHandler::kRefuse) refuse_inside_signal_handler(nullptr);
    InterruptState& s = state;
    if (s.depth > 0) saved.push_back(Saved{s.main_thread, std::move(s.error), std::move(s.reason), s.last_poll});
    s.error.reset();
    s.reason.clear();
    s.main_thread = on_main_thread();
    s.last_poll = Clock::now();
    ++s.depth;
}

InterruptScope::~InterruptScope() {
    InterruptState& s = state;
    --s.depth;
    s.error.reset();  // not taken: the call raised something else first
    s.reason.clear();
    if (s.depth > 0) {
        s.main_thread = saved.back().main_thread;
        if (saved.back().error) s.error.emplace(std::move(*saved.back().error));  // (no move assignment)
        s.reason = std::move(saved.back().reason);
        s.last_poll = saved.back().last_poll;
        saved.pop_back();
    }
}

const std::string* InterruptScope::interrupted() const { return state.error ? &state.reason : nullptr; }

std::optional<nb::python_error> InterruptScope::take() {
    std::optional<nb::python_error> e = std::move(state.error);
    state.error.reset();
    return e;
}

bool polls_signals_here() { return state.depth > 0 && state.main_thread; }

bool poll_signals_holding_gil() {
    InterruptState& s = state;
    if (s.depth == 0 || !s.main_thread) return false;
    // Not from inside a handler already running (its World.abort): the handlers would nest.
    if (!s.error && !handlers_running_in_wait.load(std::memory_order_relaxed)) {
        handlers_running_in_wait.store(true, std::memory_order_relaxed);
        const int raised = PyErr_CheckSignals();
        handlers_running_in_wait.store(false, std::memory_order_relaxed);
        if (raised != 0) {
            s.error.emplace();  // fetches the handler's exception
            s.reason = describe(*s.error);
            interrupts.fetch_add(1, std::memory_order_relaxed);
        }
    }
    return s.error.has_value();
}

bool keep_interrupt(nb::python_error&& e) {
    InterruptState& s = state;
    if (s.depth == 0) return false;
    if (!s.error) {
        s.reason = describe(e);
        s.error.emplace(std::move(e));
        interrupts.fetch_add(1, std::memory_order_relaxed);
    }
    return true;
}

int64_t wait_checks_on_main_thread() { return wait_checks.load(); }

int64_t interrupts_taken() { return interrupts.load(); }

void abort_interrupted(WorldHandle& world, const std::string& reason) {
    try {
        world.world.use(Admit::kOpenOrClosing)->abort("its call was interrupted by " + reason);
    } catch (const std::exception&) {  // closed meanwhile (an interrupted close), or forked: nothing to tell
    }
}

}  // namespace weft::python
