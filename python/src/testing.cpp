// SPDX-License-Identifier: MIT
// weft._weft._testing: stand-ins for the CPU tests of the binding's own machinery, not API. ClosableProbe drives the
// Closable rule that every World, op, buffer and handle follows (binding.hpp) without a GPU, which a World needs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <memory>
#include <string>

#include "binding.hpp"
#include "weft/runtime/error.hpp"

namespace weft::python {

namespace {

using namespace nb::literals;

// What the probe's object reports once it is gone: the calls that were still inside it (0 unless close() failed to
// wait for them).
struct ProbeRecord {
    std::atomic<int> calls_in_flight{0};
    std::atomic<int> in_flight_at_destruction{-1};
};

struct ProbeObject {
    std::shared_ptr<ProbeRecord> record;
    explicit ProbeObject(std::shared_ptr<ProbeRecord> r) : record(std::move(r)) {}
    ~ProbeObject() { record->in_flight_at_destruction = record->calls_in_flight.load(); }
};

struct PyClosableProbe {
    std::shared_ptr<ProbeRecord> record = std::make_shared<ProbeRecord>();
    Closable<ProbeObject> object{std::make_unique<ProbeObject>(record), "ClosableProbe"};
};

}  // namespace

void bind_testing(nb::module_& m) {
    nb::module_ sub = m.def_submodule("_testing", "stand-ins for weft's CPU tests of the binding (not API)");

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
        // `check` (if given) is called before and after the wait for the calls in flight; raising refuses the close.
        .def(
            "close",
            [](PyClosableProbe& p, nb::handle check) {
                return p.object.close([&] {
                    if (!check.is_none()) check();
                });
            },
            "check"_a = nb::none())
        .def_prop_ro("closed", [](const PyClosableProbe& p) { return p.object.closed(); })
        .def_prop_ro("calls_in_flight_at_destruction",
                     [](const PyClosableProbe& p) { return p.record->in_flight_at_destruction.load(); });
}

}  // namespace weft::python
