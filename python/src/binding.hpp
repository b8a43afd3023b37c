// SPDX-License-Identifier: MIT
// What the extension's source files share: the Store adapter over a Python store and the DLPack export.
#pragma once

#include <nanobind/nanobind.h>

#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/store.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/tensor_view.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {
struct GroupedGemmOptions;
}  // namespace weft::ops

namespace weft::python {

namespace nb = nanobind;

/// weft::Store over a Python object with torch.distributed.Store's methods: set(key, bytes), get(key) -> bytes,
/// wait([key], timedelta), add(key, int) -> int, check([key]) -> bool, delete_key(key). Every method takes the
/// GIL for the duration of its Python call only, so weft's C++ code (which runs with the GIL released) may call it
/// from any thread. A Python exception becomes a weft::Error naming the method, the key and the exception, raised
/// with the GIL already given back; one that is no Exception (KeyboardInterrupt, SystemExit) is raised as itself by
/// the interruptible call it happened in (InterruptScope). On the main thread in an interruptible call, get() waits
/// in slices of 100 ms and asks the wait check (which runs the signal handlers) after each. Destroying the adapter
/// takes the GIL to drop its reference (it leaks the reference while the interpreter finalises, when Python may no
/// longer be entered).
class PythonStore final : public Store {
public:
    explicit PythonStore(nb::object store);
    ~PythonStore() override;

    void set(const std::string& key, const Bytes& value) override;
    Bytes get(const std::string& key, std::chrono::milliseconds timeout) override;
    int64_t add(const std::string& key, int64_t delta) override;
    bool check(const std::string& key) override;
    void erase(const std::string& key) override;

private:
    Bytes get_once(const std::string& key, std::chrono::milliseconds timeout);

    nb::object store_;
    nb::object timedelta_;  ///< datetime.timedelta
};

/// Whether the interpreter is finalising (Py_IsFinalizing is public from Python 3.13).
inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing() != 0;
#else
    return _Py_IsFinalizing() != 0;
#endif
}

/// Whether this process was forked since the extension was loaded (a pthread_atfork handler sets it: interrupt.cpp).
bool process_forked();
/// This process's id, as the fork handler keeps it (no getpid() system call per call).
pid_t process_id();
/// "<who>: this process was forked from process <pid> after <who> was made there ...": what a call on an object the
/// parent made raises in a forked child.
std::string forked_message(const char* who, pid_t made_in);

/// Throws weft::Error when the calling thread runs a Python signal handler from inside a weft call's wait (the
/// interruptible calls below): weft's state is mid-call there, so a call into weft from the handler would start a
/// second exchange while the peers are in the first. `who` (may be null) names the object called.
void refuse_inside_signal_handler(const char* who);

/// Which calls a closing object still lets in.
enum class Admit {
    kOpen,           ///< refused from the moment close() starts, and from a signal handler inside a weft call
    kOpenOrClosing,  ///< also while close() waits, and from such a handler (World.abort: what ends the calls a close
                     ///< waits for, and all that handler may do)
};

/// One object with a close() (a World, an op, an EP buffer or handle) and the calls in flight on it, across Python
/// threads. Every binding that uses the object holds a Use for the call's duration. close() makes new calls fail at
/// once ("<name> is closing"), waits with the GIL released (a call in flight may need it: a Python store) until the
/// calls in flight have ended, then destroys the object. A close() from inside a call on the same thread (a Python
/// callback of that call) is a weft::Error: it would wait for itself. The wait has no bound of its own: each call in
/// flight is bounded by the World's timeout, and World.abort, which is admitted while closing, ends them sooner.
/// In a process forked after the object was made, every call and close() raise weft::Error naming the parent
/// (forked_message), and the object is never destroyed there: it is the parent's (its World's rank, store connection
/// and GPU context), and destroying it would close it collectively in the parent's name.
/// On the main thread, inside an interruptible call (an op's close(), whose interruption also aborts its World, which
/// ends the calls it waited for), Ctrl-C ends close()'s waits: the object is left open and the interruption raised.
/// NOTE: the mutex is never held while waiting for the GIL, so taking it with the GIL held cannot deadlock. In a
/// forked child the mutex is never taken (a parent thread may have held it at the fork, and that thread is gone):
/// every path checks forked_since_made() first.
template <class T>
class Closable {
public:
    Closable(std::unique_ptr<T> object, const char* name) : object_(std::move(object)), name_(name) {}
    ~Closable() {
        if (forked_since_made()) (void)object_.release();
    }
    Closable(const Closable&) = delete;
    Closable& operator=(const Closable&) = delete;

    /// A call on the object: the object stays alive and open until the Use ends (`c.use()->f()` holds it for f: a
    /// temporary lives to the end of its full expression).
    class Use {
    public:
        /// Throws weft::Error "<name> is closed", or "<name> is closing" unless `admit` lets it in, or (kOpen) from
        /// a signal handler inside a weft call (refuse_inside_signal_handler); `name` overrides the object's name in
        /// the message.
        Use(const Closable& c, Admit admit, const char* name) : c_(c) {
            const char* who = name != nullptr ? name : c_.name_;
            if (c_.forked_since_made()) throw Error("weft: " + forked_message(who, c_.pid_));
            if (admit == Admit::kOpen) refuse_inside_signal_handler(who);
            std::lock_guard<std::mutex> lock(c_.mutex_);
            WEFT_CHECK(c_.object_ != nullptr, who << " is closed");
            WEFT_CHECK(!c_.closing_ || admit == Admit::kOpenOrClosing,
                       who << " is closing (close() was called on another thread); no new call may start on it");
            c_.callers_.push_back(std::this_thread::get_id());
        }
        ~Use() {
            std::lock_guard<std::mutex> lock(c_.mutex_);
            c_.callers_.erase(std::find(c_.callers_.begin(), c_.callers_.end(), std::this_thread::get_id()));
            if (c_.closing_ && c_.callers_.empty()) c_.idle_.notify_all();
        }
        Use(const Use&) = delete;
        Use& operator=(const Use&) = delete;
        T& operator*() const { return *c_.object_; }
        T* operator->() const { return c_.object_.get(); }

    private:
        const Closable& c_;
    };

    Use use(Admit admit = Admit::kOpen, const char* name = nullptr) const { return Use(*this, admit, name); }

    bool closed() const {
        if (forked_since_made()) return object_ == nullptr;  // no lock (see the NOTE); nothing changes it here
        std::lock_guard<std::mutex> lock(mutex_);
        return object_ == nullptr;
    }

    /// Closes the object; a no-op once closed. `check` refuses by throwing: it runs first, and again once the calls
    /// in flight have ended (one of them may have made what it checks for, an op on a World). Called with the GIL
    /// held; destroys the object with the GIL released. Returns whether this call closed it.
    template <class Check>
    bool close(Check&& check) {
        if (closed()) return false;
        if (forked_since_made()) throw Error("weft: " + forked_message(name_, pid_));
        check();
        {
            nb::gil_scoped_release release;
            std::unique_lock<std::mutex> lock(mutex_);
            WEFT_CHECK(std::find(callers_.begin(), callers_.end(), std::this_thread::get_id()) == callers_.end(),
                       "close() of " << name_
                                     << " was called from inside a call on it on the same thread (a callback "
                                        "of that call) and would wait for itself; close it after the call returns");
            // Another thread's close() of it, if any, ends first.
            if (auto why = wait_idle(lock, [&] { return !closing_; })) throw Error(interrupted(*why));
            if (object_ == nullptr) return false;
            closing_ = true;
            if (auto why = wait_idle(lock, [&] { return callers_.empty(); })) {
                reopen();  // left open, as a refusal leaves it
                throw Error(interrupted(*why));
            }
        }
        try {
            check();  // the GIL held again
        } catch (...) {
            std::lock_guard<std::mutex> lock(mutex_);
            reopen();  // left open, as a refusal leaves it
            throw;
        }
        nb::gil_scoped_release release;
        std::unique_ptr<T> gone;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            // A call admitted while closing (World.abort) may have started during the check: it ends first.
            if (auto why = wait_idle(lock, [&] { return callers_.empty(); })) {
                reopen();
                throw Error(interrupted(*why));
            }
            gone = std::move(object_);
            closing_ = false;
            idle_.notify_all();
        }
        gone.reset();
        return true;
    }

    /// For the owner's destructor, where no call can be in flight (each call holds a reference to the Python object
    /// being destroyed): destroys the object at once, with the GIL released when this thread holds it and the
    /// interpreter is not finalising (a fused op's collective frees wait on the store, whose Python methods need the
    /// GIL); in a forked child, leaves it (the parent's) undestroyed.
    void destroy_now() {
        if (forked_since_made()) {
            (void)object_.release();
            return;
        }
        std::unique_ptr<T> gone;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            gone = std::move(object_);
        }
        if (gone != nullptr && !interpreter_finalizing() && PyGILState_Check()) {
            nb::gil_scoped_release release;
            gone.reset();
        }
    }
    /// Leaves the object to the process's exit (while the interpreter finalises).
    void leak() {
        if (forked_since_made()) {
            (void)object_.release();
            return;
        }
        std::lock_guard<std::mutex> lock(mutex_);
        (void)object_.release();
    }

    /// True in a process forked after the object was made (its parent's). Two relaxed atomic loads, no lock.
    bool forked_since_made() const { return process_forked() && process_id() != pid_; }

private:
    /// Waits (the mutex held by `lock`) until `done`, asking the wait check (weft::wait_interrupted: on the main thread
    /// inside an interruptible call, Ctrl-C or a signal handler that raised) each time 100 ms ran out, the mutex
    /// released while it asks (it takes the GIL to run the handlers). Its reason when it interrupted the wait.
    template <class Done>
    std::optional<std::string> wait_idle(std::unique_lock<std::mutex>& lock, Done done) const {
        while (!idle_.wait_for(lock, std::chrono::milliseconds(100), done)) {
            lock.unlock();
            std::optional<std::string> why = wait_interrupted();
            lock.lock();
            if (why && !done()) return why;
        }
        return std::nullopt;
    }
    /// An interrupted close(): what it raises (the interruptible call it runs in raises the interruption instead).
    std::string interrupted(const std::string& why) const {
        return std::string("close() of ") + name_ + " was " + why + " while it waited; " + name_ + " is still open";
    }
    /// A close() that ends without closing (refused or interrupted): calls may start again, other closes go on. The
    /// mutex held.
    void reopen() {
        closing_ = false;
        idle_.notify_all();
    }

    std::unique_ptr<T> object_;  ///< changed under the mutex; null once closed
    const char* name_;
    const pid_t pid_ = process_id();  ///< the process that made it
    mutable std::mutex mutex_;
    mutable std::condition_variable idle_;          ///< signalled when callers_ empties and when a close() ends
    mutable std::vector<std::thread::id> callers_;  ///< one entry per call in flight
    bool closing_ = false;
};

/// Makes `device` current for a call (a World's GPU, or a local op's: its tensors' device, which need not be the
/// thread's current one; a new Python thread starts on device 0) and restores the previous device after it, unless the
/// thread had no context current before (it never used a device: restoring "device 0" would create a context there for
/// nothing; `device` then stays current).
class DeviceScope {
public:
    explicit DeviceScope(int device) {
        WEFT_CUDA_CHECK(cudaGetDevice(&previous_));
        if (device == previous_) return;
        CUcontext current = nullptr;
        WEFT_CU_CHECK(driver().cuCtxGetCurrent(&current));
        restore_ = current != nullptr;
        WEFT_CUDA_CHECK(cudaSetDevice(device));
    }
    ~DeviceScope() {
        if (restore_) cudaSetDevice(previous_);
    }
    DeviceScope(const DeviceScope&) = delete;
    DeviceScope& operator=(const DeviceScope&) = delete;

private:
    int previous_ = 0;
    bool restore_ = false;
};

/// A World and the count of the objects made on it (ops, buffers) that must go before it does. `live_objects`
/// changes and is read with the GIL held.
struct WorldHandle {
    Closable<World> world;
    int live_objects = 0;

    explicit WorldHandle(std::unique_ptr<World> made) : world(std::move(made), "this World") {}
    /// The check World.close() makes before and after waiting for the calls in flight.
    void check_no_live_objects() const {
        WEFT_CHECK(live_objects == 0, "World.close: " << live_objects
                                                      << " op(s) or buffer(s) made on this World are still open; "
                                                         "close them first (weft.finalize does)");
    }
};
using WorldRef = std::shared_ptr<WorldHandle>;
using WorldUse = Closable<World>::Use;

struct PyWorld {
    WorldRef h;

    explicit PyWorld(std::unique_ptr<World> world) : h(std::make_shared<WorldHandle>(std::move(world))) {}
    /// Collective. The Python layer closes Worlds explicitly; a World dropped open is closed here like close() does
    /// (calls in flight through its teams are waited for, the GIL released: its watchdog's store calls may need it),
    /// except while the interpreter finalises or in a process forked after it was made (the World is then left to the
    /// process's exit).
    ~PyWorld() {
        if (!h || h->world.closed() || h->live_objects != 0) return;
        if (interpreter_finalizing() || h->world.forked_since_made()) {
            h->world.leak();
            return;
        }
        try {
            h->world.close([&] { h->check_no_live_objects(); });
        } catch (const std::exception&) {
            // Refused (a call on this thread is inside it): the World goes with the last team that refers to it.
        }
    }
    WorldUse use(Admit admit = Admit::kOpen) const { return h->world.use(admit); }
    void close() {
        h->world.close([&] { h->check_no_live_objects(); });
    }
};

// ---- Ctrl-C and Python's signal handlers during a blocking call (interrupt.cpp) ----
// CPython runs a signal's Python handler only when the main thread runs bytecode again: a call that waits in C++ for
// minutes (a peer that never comes) would hold Ctrl-C back as long. So the blocking calls run as interruptible calls:
// on the main thread, weft's host waits ask the check install_process_hooks installs each time a wait slice ran out
// (100-250 ms), and it runs the pending handlers (PyErr_CheckSignals), at most once per 100 ms. A handler's exception
// (KeyboardInterrupt) ends the waits: the call unwinds, its World is aborted (the peers stop waiting for this rank),
// and the exception is raised as itself. A handler runs in the middle of the call, so while it runs, every call into
// weft on that thread is refused (refuse_inside_signal_handler) except World.abort.

/// Registers the check with the runtime (weft::set_wait_interrupt_check) and the fork handler; at import.
void install_process_hooks();

/// Whether a call may start from a signal handler that runs inside a weft call's wait on the same thread.
enum class FromSignalHandler {
    kRefuse,  ///< weft::Error (refuse_inside_signal_handler): every call but World.abort
    kAllow,   ///< World.abort
};

/// One interruptible call on this thread, made with the GIL held. Nests only for a call a signal handler may make
/// (FromSignalHandler::kAllow): any other throws weft::Error there, before anything is changed.
class InterruptScope {
public:
    explicit InterruptScope(FromSignalHandler from_handler = FromSignalHandler::kRefuse);
    ~InterruptScope();
    InterruptScope(const InterruptScope&) = delete;
    InterruptScope& operator=(const InterruptScope&) = delete;
    /// Why the call was interrupted, or nullptr.
    const std::string* interrupted() const;
    /// Takes the exception to raise (after the call has unwound), if any.
    std::optional<nb::python_error> take();
};

/// Whether this thread is in an interruptible call on Python's main thread (the one whose waits run the handlers).
bool polls_signals_here();
/// With the GIL held, where polls_signals_here(): runs the pending signal handlers (marked as running inside a weft
/// call: refuse_inside_signal_handler) and keeps the exception one raised for the call (InterruptScope). Called
/// before any C-API call that would run them and lose it (str() of an error runs them first). True once the call was
/// interrupted.
bool poll_signals_holding_gil();
/// Keeps `e`, an exception a Python store method raised that is no Exception (KeyboardInterrupt, SystemExit), for
/// the interruptible call on this thread, to be raised as itself. False when no such call is in progress here.
bool keep_interrupt(nb::python_error&& e);
/// For the tests (weft._weft._testing): how often the wait check was asked on the main thread inside an
/// interruptible call, and how many interruptions calls have kept (a handler's exception, or a store's
/// KeyboardInterrupt or SystemExit), in this process.
int64_t wait_checks_on_main_thread();
int64_t interrupts_taken();
/// World::abort(reason) of `world` (ignored when it is closed or its abort fails), with the GIL released.
void abort_interrupted(WorldHandle& world, const std::string& reason);

/// Runs `fn` (C++ only) as an interruptible call, the GIL released unless kHoldsGil (`fn` then releases it itself
/// around its waits). When interrupted, `world` (null: none) is aborted once `fn` has ended, whatever `fn` returned
/// or threw, and the interrupting exception is raised instead. From a signal handler that runs inside a weft call on
/// this thread, throws weft::Error at once unless kFromHandler allows it.
template <bool kHoldsGil = false, FromSignalHandler kFromHandler = FromSignalHandler::kRefuse, class Fn>
auto interruptible(WorldHandle* world, Fn&& fn) -> decltype(fn()) {
    using R = decltype(fn());
    InterruptScope scope(kFromHandler);
    std::exception_ptr failure;
    std::optional<std::conditional_t<std::is_void_v<R>, bool, R>> result;
    const auto run = [&] {
        try {
            if constexpr (std::is_void_v<R>) {
                fn();
                result.emplace(true);
            } else {
                result.emplace(fn());
            }
        } catch (...) {
            failure = std::current_exception();
        }
    };
    const auto after_interrupt = [&] {  // the GIL released
        if (world != nullptr) abort_interrupted(*world, *scope.interrupted());
        result.reset();  // a World made regardless is closed here, without the GIL its watchdog may need
    };
    if constexpr (kHoldsGil) {
        run();
        if (scope.interrupted() != nullptr) {
            nb::gil_scoped_release release;
            after_interrupt();
        }
    } else {
        nb::gil_scoped_release release;
        run();
        if (scope.interrupted() != nullptr) after_interrupt();
    }
    if (std::optional<nb::python_error> e = scope.take()) throw std::move(*e);
    if (failure) std::rethrow_exception(failure);
    if constexpr (!std::is_void_v<R>) return std::move(*result);
}

template <class Fn, class R, class First, class... Rest>
auto interruptibly_impl(Fn fn, R (Fn::*)(First, Rest...) const) {
    return [fn = std::move(fn)](First first, Rest... rest) -> R {
        WorldHandle* world = nullptr;
        if constexpr (requires { first.h.get(); }) world = first.h.get();
        return interruptible(world, [&]() -> R { return fn(std::forward<First>(first), std::forward<Rest>(rest)...); });
    };
}

/// A binding's lambda, whose first parameter is the object called, as one that runs it through interruptible(): the
/// World aborted on an interruption is that object's (its member `h`: a World, team, op or EP buffer), if it has one.
template <class Fn>
auto interruptibly(Fn fn) {
    return interruptibly_impl(std::move(fn), &Fn::operator());
}

/// A Team of a World. Its World may be closed under it (weft.finalize): use() refuses then. get(call) refuses a team
/// of another World than the call's (each refers to its own World's state); the call holds a use of its World.
struct PyTeam {
    WorldRef h;
    Team team;

    WorldUse use() const { return h->world.use(Admit::kOpen, "this team's World"); }
    const Team& get(const WorldRef* call = nullptr) const {
        WEFT_CHECK(call == nullptr || *call == h,
                   "the team belongs to another World than the call's (a team made before weft.finalize, or of "
                   "another World); make it from the call's World");
        return team;
    }
};

/// B's layout from its code (0: kNK, 1: kKN), else weft::Error (module.cpp).
BLayout as_b_layout(int code);
/// A grouped GEMM's options from the bindings' arguments: its SM budget, the rows per group it plans for, and a status
/// tensor (status_record, made by weft.grouped_status()) or none (module.cpp).
ops::GroupedGemmOptions grouped_options(int sm_budget, int64_t expected_rows_per_group,
                                        const std::optional<TensorView>& status);

/// The record behind an op's `status` tensor: a contiguous int32 tensor of 4 elements (the record's four fields in
/// order, as `maker` makes one), else weft::Error; null for none.
template <class Record>
Record* status_record(const std::optional<TensorView>& status, const char* maker) {
    static_assert(sizeof(Record) == 4 * sizeof(int32_t), "a status record is four int32 fields");
    if (!status) return nullptr;
    WEFT_CHECK(
        status->dtype == DType::kI32 && status->ndim == 1 && status->dim(0) == 4 && status->stride(0) == 1,
        "status: expected a contiguous int32 tensor of 4 elements (" << maker << "), got " << status->describe());
    return static_cast<Record*>(status->data);
}

/// A stream from Python (torch.cuda.Stream.cuda_stream: an integer).
inline cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// An op made on a World: counted by the World, destroyed collectively by close(). Its World cannot close while it is
// open, so its calls hold a use of the op alone.
template <class Op>
struct PyOp {
    WorldRef h;
    int device;  ///< the World's GPU, current during the op's calls
    Closable<Op> op;

    PyOp(WorldRef world, int world_device, std::unique_ptr<Op> made, const char* op_name)
        : h(std::move(world)), device(world_device), op(std::move(made), op_name) {
        ++h->live_objects;
    }
    ~PyOp() {
        if (!op.closed()) {
            op.destroy_now();
            --h->live_objects;
        }
    }
    typename Closable<Op>::Use use() const { return op.use(); }
    /// The count drops inside the call: an interrupt raised after the op was closed must not leave it counted.
    void close() {
        interruptible<true>(h.get(), [&] {
            if (op.close([] {})) --h->live_objects;
        });
    }
};

/// Binds the TP MoE layers and the gathered layout's routing (weft/ops/moe_tp.hpp) into `m` (moe.cpp).
void bind_moe(nb::module_& m);

/// Binds weft::ops::ep into the submodule `ep` of `m` (ep.cpp).
void bind_ep(nb::module_& m);

/// Binds the CPU tests' stand-ins into the submodule `_testing` of `m` (testing.cpp).
void bind_testing(nb::module_& m);

/// A DLPack capsule ("dltensor", DLManagedTensor) describing `view` on CUDA device `device`, for
/// torch.utils.dlpack.from_dlpack. Owns nothing but its shape arrays: the memory stays the caller's (the
/// symmetric heap's), and the consumer's deleter only frees the description.
nb::object make_dlpack_capsule(const TensorView& view, int device);

}  // namespace weft::python
