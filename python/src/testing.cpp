// SPDX-License-Identifier: MIT
// weft._weft._testing: stand-ins for the CPU tests of the binding's own machinery, not API. ClosableProbe drives the
// Closable rule that every World, op, buffer and handle follows (binding.hpp) without a GPU, which a World needs;
// wait_in_cpp waits as a store written in C does (torch's), where no Python signal handler runs; the counters tell
// whether a signal was taken by weft's wait check rather than by Python between bytecodes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "binding.hpp"
#include "weft/runtime/error.hpp"

namespace weft::python {

namespace {

using namespace nb::literals;

// What the probe's object reports once it is gone: the calls that were still inside it (0 unless close() failed to
// wait for them), and whether it was destroyed with the GIL held. Outlives the probe (ClosableProbe.record).
struct ProbeRecord {
    std::atomic<int> calls_in_flight{0};
    std::atomic<int> in_flight_at_destruction{-1};
    std::atomic<bool> destroyed{false};
    std::atomic<bool> destroyed_holding_gil{false};
};

struct ProbeObject {
    std::shared_ptr<ProbeRecord> record;
    explicit ProbeObject(std::shared_ptr<ProbeRecord> r) : record(std::move(r)) {}
    ~ProbeObject() {
        record->in_flight_at_destruction = record->calls_in_flight.load();
        record->destroyed_holding_gil = PyGILState_Check() != 0;
        record->destroyed = true;
    }
};

struct PyClosableProbe {
    std::shared_ptr<ProbeRecord> record = std::make_shared<ProbeRecord>();
    Closable<ProbeObject> object{std::make_unique<ProbeObject>(record), "ClosableProbe"};
    ~PyClosableProbe() { object.destroy_now(); }  // as an op dropped open is destroyed
};

}  // namespace

void bind_testing(nb::module_& m) {
    nb::module_ sub = m.def_submodule("_testing", "stand-ins for weft's CPU tests of the binding (not API)");

    nb::class_<ProbeRecord>(sub, "ProbeRecord")
        .def_prop_ro("destroyed", [](const ProbeRecord& r) { return r.destroyed.load(); })
        .def_prop_ro("destroyed_holding_gil", [](const ProbeRecord& r) { return r.destroyed_holding_gil.load(); });

    nb::class_<PyClosableProbe>(sub, "ClosableProbe")
        .def(nb::init<>())
        // Like a World call: the GIL released, a use held throughout; `callback` (if given) runs inside the call
        // with the GIL taken, as a Python store's methods do. Its exception becomes a weft.Error, like a store's.
        .def(
            "call",
            [](PyClosableProbe& p, nb::handle callback) {
                const auto use = p.object.use();
                ++use->record->calls_in_flight;
                std::string failure;
                if (!callback.is_none()) {
                    nb::gil_scoped_acquire gil;
                    try {
                        callback();
                    } catch (nb::python_error& e) {
                        failure = e.what();
                    }
                }
                --use->record->calls_in_flight;
                WEFT_CHECK(failure.empty(), "ClosableProbe.call: the callback raised: " << failure);
            },
            "callback"_a = nb::none(), nb::call_guard<nb::gil_scoped_release>())
        // Like World.abort: admitted while closing and from a signal handler that runs inside a weft call; an
        // interruptible call (of no World) that does nothing.
        .def("abort",
             [](PyClosableProbe& p) {
                 const auto use = p.object.use(Admit::kOpenOrClosing);
                 interruptible<false, FromSignalHandler::kAllow>(nullptr, [] {});
             })
        // `check` (if given) is called before and after the wait for the calls in flight; raising refuses the close.
        // An interruptible call, as an op's close() is (of no World: nothing to abort).
        .def(
            "close",
            [](PyClosableProbe& p, nb::handle check) {
                return interruptible<true>(nullptr, [&] {
                    return p.object.close([&] {
                        if (!check.is_none()) check();
                    });
                });
            },
            "check"_a = nb::none())
        .def_prop_ro("closed", [](const PyClosableProbe& p) { return p.object.closed(); })
        .def_prop_ro("calls_in_flight_at_destruction",
                     [](const PyClosableProbe& p) { return p.record->in_flight_at_destruction.load(); })
        .def_prop_ro("record", [](const PyClosableProbe& p) { return p.record; });
    sub.def("wait_checks_on_main_thread", &wait_checks_on_main_thread,
            "how often weft's wait check was asked on the main thread inside an interruptible call (a wait slice ran "
            "out there)");
    sub.def("interrupts_taken", &interrupts_taken,
            "how many interruptions weft's calls have kept (a signal handler's exception run by the wait check, or a "
            "store method's KeyboardInterrupt or SystemExit)");
    // A store's wait([keys], timedelta) written in C, as torch's TCPStore's is: blocks for the whole timeout with the
    // GIL released and no signal handler run, then raises TimeoutError (the tests' keys never come).
    sub.def(
        "wait_in_cpp",
        [](nb::handle /*keys*/, nb::handle timeout) {
            const double seconds = nb::cast<double>(timeout.attr("total_seconds")());
            {
                nb::gil_scoped_release release;
                std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
            }
            PyErr_SetString(PyExc_TimeoutError, "timed out waiting for the keys");
            throw nb::python_error();
        },
        "keys"_a, "timeout"_a);
}

}  // namespace weft::python
