// SPDX-License-Identifier: MIT
// PythonStore: weft::Store over a Python object that speaks torch.distributed.Store's methods.
#include <Python.h>

#include "binding.hpp"

#include <nanobind/stl/string.h>

#include <algorithm>

#include "weft/runtime/error.hpp"
#include "weft/runtime/store.hpp"

namespace weft::python {

using namespace nb::literals;

namespace {

// "TypeName: message" of a Python exception (its traceback belongs to the Python side, not to weft's message).
std::string describe(nb::python_error& e) {
    try {
        std::string name = nb::cast<std::string>(e.type().attr("__qualname__"));
        std::string message = nb::cast<std::string>(nb::str(e.value()));
        return message.empty() ? name : name + ": " + message;
    } catch (...) {
        return e.what();
    }
}

// Runs `fn` (which calls into Python) with the GIL held; a Python exception becomes a weft::Error thrown after the
// GIL is released again, so the exception object never needs the GIL. One that is no Exception (KeyboardInterrupt,
// SystemExit) is also kept for the interruptible call in progress on this thread, which raises it as itself.
template <class Fn>
auto with_gil(const char* method, const std::string& key, Fn&& fn) -> decltype(fn()) {
    std::string failure;
    {
        nb::gil_scoped_acquire gil;
        try {
            return fn();
        } catch (nb::python_error& e) {
            poll_signals_holding_gil();  // a signal that came during the call: its handler runs here, not in describe
            failure = describe(e);
            if (!e.matches(PyExc_Exception)) keep_interrupt(std::move(e));
        } catch (const std::exception& e) {
            failure = e.what();
        }
    }
    WEFT_FAIL("store." << method << "('" << key << "') raised: " << failure);
}

// How long one wait of the store lasts on a thread that runs the signal handlers between waits.
constexpr std::chrono::milliseconds kSignalPollSlice{100};

}  // namespace

PythonStore::PythonStore(nb::object store) : store_(std::move(store)) {
    WEFT_CHECK(store_.is_valid() && !store_.is_none(), "store: expected a store object, got None");
    for (const char* method : {"set", "get", "wait", "add", "check", "delete_key"}) {
        WEFT_CHECK(nb::hasattr(store_, method),
                   "store: expected an object with torch.distributed.Store's methods (set, get, wait, add, check, "
                   "delete_key); it has no '" << method << "'");
    }
    timedelta_ = nb::module_::import_("datetime").attr("timedelta");
}

PythonStore::~PythonStore() {
    if (!Py_IsInitialized() || interpreter_finalizing()) {
        // NOTE: Python can no longer be entered; the references are leaked on purpose.
        store_.release();
        timedelta_.release();
        return;
    }
    nb::gil_scoped_acquire gil;
    store_.reset();
    timedelta_.reset();
}

void PythonStore::set(const std::string& key, const Bytes& value) {
    with_gil("set", key, [&] {
        store_.attr("set")(key, nb::bytes(reinterpret_cast<const char*>(value.data()), value.size()));
    });
}

// A store's wait may block in C with the GIL released, as torch's do, where no signal handler runs: on the thread that
// runs them (the main thread, in an interruptible call) it waits in slices and asks for them in between.
Bytes PythonStore::get(const std::string& key, std::chrono::milliseconds timeout) {
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + timeout;
    while (true) {
        const auto left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                                   std::chrono::milliseconds(0));
        const bool sliced = polls_signals_here() && left > kSignalPollSlice;
        const auto slice = sliced ? kSignalPollSlice : left;
        const auto slice_start = Clock::now();
        try {
            return get_once(key, slice);
        } catch (const Error&) {
            // A slice that ended early failed for another reason than its timeout: that failure is the answer.
            if (!sliced || Clock::now() - slice_start < slice / 2) throw;
        }
        if (std::optional<std::string> why = wait_interrupted()) {
            WEFT_FAIL("store.get('" << key << "') stopped: " << *why);
        }
    }
}

Bytes PythonStore::get_once(const std::string& key, std::chrono::milliseconds timeout) {
    return with_gil("get", key, [&] {
        nb::list keys;
        keys.append(nb::str(key.c_str(), key.size()));
        // torch's stores read a zero timeout as "no timeout": the shortest wait they take is 1 ms.
        const auto ms = std::max<int64_t>(timeout.count(), 1);
        store_.attr("wait")(keys, timedelta_("milliseconds"_a = static_cast<double>(ms)));
        nb::object value = store_.attr("get")(key);
        if (nb::isinstance<nb::str>(value)) value = value.attr("encode")("utf-8");
        WEFT_CHECK(nb::isinstance<nb::bytes>(value), "store.get('" << key << "') returned "
                                                                   << nb::type_name(value.type()).c_str()
                                                                   << ", expected bytes");
        nb::bytes b = nb::borrow<nb::bytes>(value);
        const auto* data = static_cast<const uint8_t*>(b.data());
        return Bytes(data, data + b.size());
    });
}

int64_t PythonStore::add(const std::string& key, int64_t delta) {
    return with_gil("add", key, [&] { return nb::cast<int64_t>(store_.attr("add")(key, delta)); });
}

bool PythonStore::check(const std::string& key) {
    return with_gil("check", key, [&] {
        nb::list keys;
        keys.append(nb::str(key.c_str(), key.size()));
        return nb::cast<bool>(store_.attr("check")(keys));
    });
}

void PythonStore::erase(const std::string& key) {
    with_gil("delete_key", key, [&] { store_.attr("delete_key")(key); });
}

}  // namespace weft::python
