// SPDX-License-Identifier: MIT
// What the extension's source files share: the Store adapter over a Python store and the DLPack export.
#pragma once

#include <nanobind/nanobind.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "weft/runtime/store.hpp"
#include "weft/runtime/error.hpp"
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

/// A World and the count of the objects made on it (ops, buffers) that must go before it does.
struct WorldHandle {
    std::unique_ptr<World> world;
    int live_objects = 0;

    World& get() const {
        WEFT_CHECK(world != nullptr, "this World is closed");
        return *world;
    }
};
using WorldRef = std::shared_ptr<WorldHandle>;

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

    explicit PyWorld(std::unique_ptr<World> world) : h(std::make_shared<WorldHandle>()) {
        h->world = std::move(world);
    }
    /// Collective. The Python layer closes Worlds explicitly; a World dropped open is destroyed here, the GIL
    /// released (its watchdog's store calls may need it: a torch store), except while the interpreter finalises
    /// (the World is then left to the process's exit).
    ~PyWorld() {
        if (!h || !h->world || h->live_objects != 0) return;
        if (interpreter_finalizing()) {
            (void)h->world.release();
            return;
        }
        std::unique_ptr<World> world = std::move(h->world);
        nb::gil_scoped_release release;
        world.reset();
    }
    void close() {
        if (!h->world) return;
        WEFT_CHECK(h->live_objects == 0, "World.close: " << h->live_objects
                                                           << " op(s) or buffer(s) made on this World are still "
                                                              "open; close them first (weft.finalize does)");
        std::unique_ptr<World> world = std::move(h->world);
        nb::gil_scoped_release release;
        world.reset();
    }
};

/// A Team of a World. Its World may be closed under it (weft.finalize): get() refuses then, and when `call` is
/// given, a team of another World than the call's (each refers to its own World's state).
struct PyTeam {
    WorldRef h;
    Team team;

    const Team& get(const WorldRef* call = nullptr) const {
        WEFT_CHECK(h->world != nullptr,
                   "this team's World is closed (weft.finalize); make the team again from the "
                   "current World");
        WEFT_CHECK(call == nullptr || *call == h,
                   "the team belongs to another World than the call's (a team made before weft.finalize, or of "
                   "another World); make it from the call's World");
        return team;
    }
};

/// Binds weft::ops::ep into the submodule `ep` of `m` (ep.cpp).
void bind_ep(nb::module_& m);

/// A DLPack capsule ("dltensor", DLManagedTensor) describing `view` on CUDA device `device`, for
/// torch.utils.dlpack.from_dlpack. Owns nothing but its shape arrays: the memory stays the caller's (the
/// symmetric heap's), and the consumer's deleter only frees the description.
nb::object make_dlpack_capsule(const TensorView& view, int device);

}  // namespace weft::python
