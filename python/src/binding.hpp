// SPDX-License-Identifier: MIT
// What the extension's source files share: the Store adapter over a Python store and the DLPack export.
#pragma once

#include <nanobind/nanobind.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/store.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/tensor_view.hpp"
#include "weft/runtime/world.hpp"

namespace weft::python {

namespace nb = nanobind;

/// weft::Store over a Python object with torch.distributed.Store's methods: set(key, bytes), get(key) -> bytes,
/// wait([key], timedelta), add(key, int) -> int, check([key]) -> bool, delete_key(key). Every method takes the
/// GIL for the duration of its Python call only, so weft's C++ code (which runs with the GIL released) may call it
/// from any thread. A Python exception becomes a weft::Error naming the method, the key and the exception, raised
/// with the GIL already given back. Destroying the adapter takes the GIL to drop its reference (it leaks the
/// reference while the interpreter finalises, when Python may no longer be entered).
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
    nb::object store_;
    nb::object timedelta_;  ///< datetime.timedelta
};

/// Which calls a closing object still lets in.
enum class Admit {
    kOpen,           ///< refused from the moment close() starts
    kOpenOrClosing,  ///< also while close() waits (World.abort: what ends the calls a close waits for)
};

/// One object with a close() (a World, an op, an EP buffer or handle) and the calls in flight on it, across Python
/// threads. Every binding that uses the object holds a Use for the call's duration. close() makes new calls fail at
/// once ("<name> is closing"), waits with the GIL released (a call in flight may need it: a Python store) until the
/// calls in flight have ended, then destroys the object. A close() from inside a call on the same thread (a Python
/// callback of that call) is a weft::Error: it would wait for itself. The wait has no bound of its own: each call in
/// flight is bounded by the World's timeout, and World.abort, which is admitted while closing, ends them sooner.
/// NOTE: the mutex is never held while waiting for the GIL, so taking it with the GIL held cannot deadlock.
template <class T>
class Closable {
public:
    Closable(std::unique_ptr<T> object, const char* name) : object_(std::move(object)), name_(name) {}
    Closable(const Closable&) = delete;
    Closable& operator=(const Closable&) = delete;

    /// A call on the object: the object stays alive and open until the Use ends (`c.use()->f()` holds it for f: a
    /// temporary lives to the end of its full expression).
    class Use {
    public:
        /// Throws weft::Error "<name> is closed", or "<name> is closing" unless `admit` lets it in; `name`
        /// overrides the object's name in the message.
        Use(const Closable& c, Admit admit, const char* name) : c_(c) {
            std::lock_guard<std::mutex> lock(c_.mutex_);
            const char* who = name != nullptr ? name : c_.name_;
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
        std::lock_guard<std::mutex> lock(mutex_);
        return object_ == nullptr;
    }

    /// Closes the object; a no-op once closed. `check` refuses by throwing: it runs first, and again once the calls
    /// in flight have ended (one of them may have made what it checks for, an op on a World). Called with the GIL
    /// held; destroys the object with the GIL released. Returns whether this call closed it.
    template <class Check>
    bool close(Check&& check) {
        if (closed()) return false;
        check();
        {
            nb::gil_scoped_release release;
            std::unique_lock<std::mutex> lock(mutex_);
            WEFT_CHECK(std::find(callers_.begin(), callers_.end(), std::this_thread::get_id()) == callers_.end(),
                       "close() of " << name_
                                     << " was called from inside a call on it on the same thread (a callback "
                                        "of that call) and would wait for itself; close it after the call returns");
            idle_.wait(lock, [&] { return !closing_; });  // another thread's close() of it, if any, ends first
            if (object_ == nullptr) return false;
            closing_ = true;
            idle_.wait(lock, [&] { return callers_.empty(); });
        }
        try {
            check();  // the GIL held again
        } catch (...) {
            std::lock_guard<std::mutex> lock(mutex_);
            closing_ = false;  // left open, as a refusal leaves it
            idle_.notify_all();
            throw;
        }
        nb::gil_scoped_release release;
        std::unique_ptr<T> gone;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            // A call admitted while closing (World.abort) may have started during the check: it ends first.
            idle_.wait(lock, [&] { return callers_.empty(); });
            gone = std::move(object_);
            closing_ = false;
            idle_.notify_all();
        }
        gone.reset();
        return true;
    }

    /// For the owner's destructor, where no call can be in flight (each call holds a reference to the Python object
    /// being destroyed): destroys the object at once, with the GIL held as before.
    void destroy_now() {
        std::unique_ptr<T> gone;
        std::lock_guard<std::mutex> lock(mutex_);
        gone = std::move(object_);
    }
    /// Leaves the object to the process's exit (while the interpreter finalises).
    void leak() {
        std::lock_guard<std::mutex> lock(mutex_);
        (void)object_.release();
    }

private:
    std::unique_ptr<T> object_;  ///< changed under the mutex; null once closed
    const char* name_;
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

/// Whether the interpreter is finalising (Py_IsFinalizing is public from Python 3.13).
inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing() != 0;
#else
    return _Py_IsFinalizing() != 0;
#endif
}

struct PyWorld {
    WorldRef h;

    explicit PyWorld(std::unique_ptr<World> world) : h(std::make_shared<WorldHandle>(std::move(world))) {}
    /// Collective. The Python layer closes Worlds explicitly; a World dropped open is closed here like close() does
    /// (calls in flight through its teams are waited for, the GIL released: its watchdog's store calls may need it),
    /// except while the interpreter finalises (the World is then left to the process's exit).
    ~PyWorld() {
        if (!h || h->world.closed() || h->live_objects != 0) return;
        if (interpreter_finalizing()) {
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

/// Binds weft::ops::ep into the submodule `ep` of `m` (ep.cpp).
void bind_ep(nb::module_& m);

/// Binds the CPU tests' stand-ins into the submodule `_testing` of `m` (testing.cpp).
void bind_testing(nb::module_& m);

/// A DLPack capsule ("dltensor", DLManagedTensor) describing `view` on CUDA device `device`, for
/// torch.utils.dlpack.from_dlpack. Owns nothing but its shape arrays: the memory stays the caller's (the
/// symmetric heap's), and the consumer's deleter only frees the description.
nb::object make_dlpack_capsule(const TensorView& view, int device);

}  // namespace weft::python
