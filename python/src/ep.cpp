// SPDX-License-Identifier: MIT
// The binding of weft::ops::ep (MoE expert-parallel dispatch and combine): Buffer and its two kinds of handle.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>

#include "binding.hpp"
#include "weft/ops/ep.hpp"
#include "weft/runtime/error.hpp"

namespace weft::python {

namespace {

namespace ep = ops::ep;
using namespace nb::literals;

// A Buffer and the handles made from it (which must be closed before it).
struct EpState {
    std::unique_ptr<ep::Buffer> buffer;
    int live_handles = 0;

    ep::Buffer& get() const {
        WEFT_CHECK(buffer != nullptr, "ep.Buffer is closed");
        return *buffer;
    }
};

struct PyEpBuffer {
    WorldRef h;
    std::shared_ptr<EpState> s = std::make_shared<EpState>();

    ~PyEpBuffer() {
        if (s->buffer && s->live_handles == 0) {
            s->buffer.reset();
            --h->live_objects;
        }
    }
    void close() {
        if (!s->buffer) return;
        WEFT_CHECK(s->live_handles == 0, "ep.Buffer.close: " << s->live_handles
                                                              << " handle(s) made from it are still open; close them "
                                                                 "first (weft.finalize does)");
        std::unique_ptr<ep::Buffer> gone = std::move(s->buffer);
        {
            nb::gil_scoped_release release;
            gone.reset();
        }
        --h->live_objects;
    }
};

template <class Handle>
struct PyEpHandle {
    std::shared_ptr<EpState> s;
    std::unique_ptr<Handle> handle;
    const char* name;

    PyEpHandle(std::shared_ptr<EpState> state, std::unique_ptr<Handle> made, const char* handle_name)
        : s(std::move(state)), handle(std::move(made)), name(handle_name) {
        ++s->live_handles;
    }
    ~PyEpHandle() {
        if (handle) {
            handle.reset();
            --s->live_handles;
        }
    }
    Handle& get() const {
        WEFT_CHECK(handle != nullptr, name << " is closed");
        return *handle;
    }
    void close() {
        if (!handle) return;
        std::unique_ptr<Handle> gone = std::move(handle);
        {
            nb::gil_scoped_release release;
            gone.reset();
        }
        --s->live_handles;
    }
};

using PyNormalHandle = PyEpHandle<ep::NormalHandle>;
using PyLowLatencyHandle = PyEpHandle<ep::LowLatencyHandle>;

ep::Phase parse_phase(const std::string& phase) {
    if (phase == "send_recv") return ep::Phase::kSendRecv;
    if (phase == "send") return ep::Phase::kSend;
    if (phase == "recv") return ep::Phase::kRecv;
    WEFT_FAIL("phase: expected 'send_recv', 'send' or 'recv', got '" << phase << "'");
}

TensorView int32_vector(const int32_t* ptr, int64_t count) {
    return TensorView(const_cast<int32_t*>(ptr), DType::kI32, {count});
}

cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

}  // namespace

void bind_ep(nb::module_& m) {
    using Release = nb::call_guard<nb::gil_scoped_release>;
    nb::module_ sub = m.def_submodule("ep", "MoE expert-parallel dispatch and combine (weft::ops::ep)");

    nb::class_<PyNormalHandle>(sub, "NormalHandle")
        .def_prop_ro("recv_x", [](const PyNormalHandle& h) { return h.get().recv_x(); })
        .def_prop_ro("expert_counts",
                     [](const PyNormalHandle& h) {
                         return int32_vector(h.get().expert_counts(), h.s->get().geometry().local_experts());
                     })
        .def_prop_ro("expert_offsets",
                     [](const PyNormalHandle& h) {  // E_local + 1: the last is the rows in all
                         return int32_vector(h.get().expert_offsets(), h.s->get().geometry().local_experts() + 1);
                     })
        .def_prop_ro("num_tokens", [](const PyNormalHandle& h) { return h.get().num_tokens(); })
        .def_prop_ro("closed", [](const PyNormalHandle& h) { return h.handle == nullptr; })
        .def("close", &PyNormalHandle::close);

    nb::class_<PyLowLatencyHandle>(sub, "LowLatencyHandle")
        .def_prop_ro("recv_x", [](const PyLowLatencyHandle& h) { return h.get().recv_x(); })
        .def_prop_ro("recv_scales", [](const PyLowLatencyHandle& h) { return h.get().recv_scales(); })
        .def_prop_ro("expert_counts", [](const PyLowLatencyHandle& h) {
            return int32_vector(h.get().expert_counts(), h.s->get().geometry().local_experts());
        })
        .def_prop_ro("fp8", [](const PyLowLatencyHandle& h) { return h.get().fp8(); })
        .def_prop_ro("closed", [](const PyLowLatencyHandle& h) { return h.handle == nullptr; })
        .def("close", &PyLowLatencyHandle::close);

    nb::class_<PyEpBuffer>(sub, "Buffer")
        .def("__init__",
             [](PyEpBuffer* self, PyWorld& w, int num_experts, int hidden, int topk, int max_tokens_per_rank,
                bool normal, bool low_latency, int64_t max_recv_tokens, int64_t max_recv_rows,
                int expert_alignment, const PyTeam* team) {
                 ep::Config c;
                 c.num_experts = num_experts;
                 c.hidden = hidden;
                 c.topk = topk;
                 c.max_tokens_per_rank = max_tokens_per_rank;
                 c.normal = normal;
                 c.low_latency = low_latency;
                 c.max_recv_tokens = max_recv_tokens;
                 c.max_recv_rows = max_recv_rows;
                 c.expert_alignment = expert_alignment;
                 World& world = w.h->get();
                 std::unique_ptr<ep::Buffer> buffer;
                 {
                     nb::gil_scoped_release release;
                     buffer = team != nullptr ? std::make_unique<ep::Buffer>(team->get(&w.h), c)
                                              : std::make_unique<ep::Buffer>(world, c);
                 }
                 auto* made = new (self) PyEpBuffer{w.h};
                 made->s->buffer = std::move(buffer);
                 ++made->h->live_objects;
             },
             "world"_a, "num_experts"_a, "hidden"_a, "topk"_a, "max_tokens_per_rank"_a, "normal"_a = true,
             "low_latency"_a = true, "max_recv_tokens"_a = 0, "max_recv_rows"_a = 0, "expert_alignment"_a = 1,
             "team"_a = nb::none())
        .def_prop_ro("num_local_experts", [](const PyEpBuffer& b) { return b.s->get().geometry().local_experts(); })
        .def_prop_ro("max_recv_rows", [](const PyEpBuffer& b) { return b.s->get().geometry().max_recv_rows; })
        .def_prop_ro("closed", [](const PyEpBuffer& b) { return b.s->buffer == nullptr; })
        .def("close", &PyEpBuffer::close)
        .def("make_normal_handle", [](PyEpBuffer& b) {
            std::unique_ptr<ep::NormalHandle> made;
            {
                nb::gil_scoped_release release;
                made = std::make_unique<ep::NormalHandle>(b.s->get().make_normal_handle());
            }
            return new PyNormalHandle(b.s, std::move(made), "ep.NormalHandle");
        }, nb::rv_policy::take_ownership)
        .def("make_low_latency_handle", [](PyEpBuffer& b) {
            auto made = std::make_unique<ep::LowLatencyHandle>(b.s->get().make_low_latency_handle());
            return new PyLowLatencyHandle(b.s, std::move(made), "ep.LowLatencyHandle");
        }, nb::rv_policy::take_ownership)
        .def("dispatch", [](PyEpBuffer& b, PyNormalHandle& h, const TensorView& x, const TensorView& topk_idx,
                            const TensorView& topk_weights, uintptr_t stream, int num_sms) {
            ep::NormalOptions o;
            o.num_sms = num_sms;
            b.s->get().dispatch(h.get(), x, topk_idx, topk_weights, as_stream(stream), o);
        }, "handle"_a, "x"_a, "topk_idx"_a, "topk_weights"_a, "stream"_a, "num_sms"_a = 0, Release())
        .def("combine", [](PyEpBuffer& b, PyNormalHandle& h, const TensorView& y, const TensorView& out,
                           uintptr_t stream, int num_sms) {
            ep::NormalOptions o;
            o.num_sms = num_sms;
            b.s->get().combine(h.get(), y, out, as_stream(stream), o);
        }, "handle"_a, "y"_a, "out"_a, "stream"_a, "num_sms"_a = 0, Release())
        .def("low_latency_dispatch", [](PyEpBuffer& b, PyLowLatencyHandle& h, const TensorView& x,
                                        const TensorView& topk_idx, uintptr_t stream, bool fp8,
                                        const std::string& phase, int num_sms) {
            ep::LowLatencyOptions o;
            o.fp8 = fp8;
            o.phase = parse_phase(phase);
            o.num_sms = num_sms;
            b.s->get().low_latency_dispatch(h.get(), x, topk_idx, as_stream(stream), o);
        }, "handle"_a, "x"_a, "topk_idx"_a, "stream"_a, "fp8"_a = false, "phase"_a = "send_recv", "num_sms"_a = 0,
           Release())
        .def("low_latency_combine", [](PyEpBuffer& b, PyLowLatencyHandle& h, const TensorView& y,
                                       const TensorView& topk_idx, const TensorView& topk_weights,
                                       const TensorView& out, uintptr_t stream, const std::string& phase,
                                       int num_sms) {
            ep::LowLatencyOptions o;
            o.phase = parse_phase(phase);
            o.num_sms = num_sms;
            b.s->get().low_latency_combine(h.get(), y, topk_idx, topk_weights, out, as_stream(stream), o);
        }, "handle"_a, "y"_a, "topk_idx"_a, "topk_weights"_a, "out"_a, "stream"_a, "phase"_a = "send_recv",
           "num_sms"_a = 0, Release())
        .def("check", [](const PyEpBuffer& b) { b.s->get().check(); })
        .def("sync_and_check", [](PyEpBuffer& b, uintptr_t stream) { b.s->get().sync_and_check(as_stream(stream)); },
             Release());
}

}  // namespace weft::python
