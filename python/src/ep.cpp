// SPDX-License-Identifier: MIT
// The binding of weft::ops::ep (MoE expert-parallel dispatch and combine): Buffer and its two kinds of handle.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>

#include "binding.hpp"
#include "weft/ops/ep.hpp"
#include "weft/ops/ep_moe.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/error.hpp"

namespace weft::python {

namespace {

namespace ep = ops::ep;
using namespace nb::literals;

// A Buffer and the count of the handles made from it (which must be closed before it; changed and read with the GIL
// held). While a handle is open its Buffer cannot close, and while the Buffer is open its World cannot.
struct EpState {
    Closable<ep::Buffer> buffer;
    int live_handles = 0;
    int device;  ///< the World's GPU: every call, and closing, runs with it current (DeviceScope)

    EpState(std::unique_ptr<ep::Buffer> made, int world_device)
        : buffer(std::move(made), "ep.Buffer"), device(world_device) {}
};

struct PyEpBuffer {
    WorldRef h;
    std::shared_ptr<EpState> s;

    ~PyEpBuffer() {
        if (!s->buffer.closed() && s->live_handles == 0) {
            s->buffer.destroy_now();
            --h->live_objects;
        }
    }
    Closable<ep::Buffer>::Use use() const { return s->buffer.use(); }
    void close() {
        DeviceScope scope(s->device);
        // The count drops inside the call: an interrupt raised after the buffer was closed must not leave it counted.
        interruptible<true>(h.get(), [&] {
            const bool closed = s->buffer.close([&] {
                WEFT_CHECK(s->live_handles == 0, "ep.Buffer.close: " << s->live_handles
                                                                     << " handle(s) made from it are still open; "
                                                                        "close them first (weft.finalize does)");
            });
            if (closed) --h->live_objects;
        });
    }
};

template <class Handle>
struct PyEpHandle {
    WorldRef h;  ///< the Buffer's World (aborted when a close is interrupted)
    std::shared_ptr<EpState> s;
    Closable<Handle> handle;

    PyEpHandle(WorldRef world, std::shared_ptr<EpState> state, std::unique_ptr<Handle> made, const char* handle_name)
        : h(std::move(world)), s(std::move(state)), handle(std::move(made), handle_name) {
        ++s->live_handles;
    }
    ~PyEpHandle() {
        if (!handle.closed()) {
            handle.destroy_now();
            --s->live_handles;
        }
    }
    typename Closable<Handle>::Use use() const { return handle.use(); }
    void close() {
        DeviceScope scope(s->device);
        interruptible<true>(h.get(), [&] {
            if (handle.close([] {})) --s->live_handles;
        });
    }
};

using PyNormalHandle = PyEpHandle<ep::NormalHandle>;
using PyLowLatencyHandle = PyEpHandle<ep::LowLatencyHandle>;
using PyMoeBlock = PyOp<ep::MoeBlock>;

ep::Phase parse_phase(const std::string& phase) {
    if (phase == "send_recv") return ep::Phase::kSendRecv;
    if (phase == "send") return ep::Phase::kSend;
    if (phase == "recv") return ep::Phase::kRecv;
    WEFT_FAIL("phase: expected 'send_recv', 'send' or 'recv', got '" << phase << "'");
}

TensorView int32_vector(const int32_t* ptr, int64_t count) {
    return TensorView(const_cast<int32_t*>(ptr), DType::kI32, {count});
}

}  // namespace

void bind_ep(nb::module_& m) {
    nb::module_ sub = m.def_submodule("ep", "MoE expert-parallel dispatch and combine (weft::ops::ep)");

    nb::class_<PyNormalHandle>(sub, "NormalHandle")
        .def_prop_ro("recv_x", [](const PyNormalHandle& h) { return h.use()->recv_x(); })
        .def_prop_ro("expert_counts",
                     [](const PyNormalHandle& h) {
                         const auto handle = h.use();  // an open handle keeps its Buffer open
                         return int32_vector(handle->expert_counts(), h.s->buffer.use()->geometry().local_experts());
                     })
        .def_prop_ro("expert_offsets",
                     [](const PyNormalHandle& h) {  // E_local + 1: the last is the rows in all
                         const auto handle = h.use();
                         return int32_vector(handle->expert_offsets(),
                                             h.s->buffer.use()->geometry().local_experts() + 1);
                     })
        .def_prop_ro("num_tokens", [](const PyNormalHandle& h) { return h.use()->num_tokens(); })
        .def_prop_ro("closed", [](const PyNormalHandle& h) { return h.handle.closed(); })
        .def("close", &PyNormalHandle::close);

    nb::class_<PyLowLatencyHandle>(sub, "LowLatencyHandle")
        .def_prop_ro("recv_x", [](const PyLowLatencyHandle& h) { return h.use()->recv_x(); })
        .def_prop_ro("recv_scales", [](const PyLowLatencyHandle& h) { return h.use()->recv_scales(); })
        .def_prop_ro("expert_counts",
                     [](const PyLowLatencyHandle& h) {
                         const auto handle = h.use();
                         return int32_vector(handle->expert_counts(), h.s->buffer.use()->geometry().local_experts());
                     })
        .def_prop_ro("fp8", [](const PyLowLatencyHandle& h) { return h.use()->fp8(); })
        .def_prop_ro("closed", [](const PyLowLatencyHandle& h) { return h.handle.closed(); })
        .def("close", &PyLowLatencyHandle::close);

    nb::class_<PyEpBuffer>(sub, "Buffer")
        .def(
            "__init__",
            [](PyEpBuffer* self, PyWorld& w, int num_experts, int hidden, int topk, int max_tokens_per_rank,
               bool normal, bool low_latency, int64_t max_recv_tokens, int64_t max_recv_rows, int expert_alignment,
               const PyTeam* team) {
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
                const WorldUse world = w.use();  // held until the buffer is counted: World.close() waits for it
                // Its memory, streams and kernels on the World's GPU; outside the interruptible call, so a buffer
                // made despite an interrupt is destroyed there too.
                DeviceScope scope(world->device());
                std::unique_ptr<ep::Buffer> buffer = interruptible(w.h.get(), [&] {
                    return team != nullptr ? std::make_unique<ep::Buffer>(team->get(&w.h), c)
                                           : std::make_unique<ep::Buffer>(*world, c);
                });
                new (self) PyEpBuffer{w.h, std::make_shared<EpState>(std::move(buffer), world->device())};
                ++w.h->live_objects;
            },
            "world"_a, "num_experts"_a, "hidden"_a, "topk"_a, "max_tokens_per_rank"_a, "normal"_a = true,
            "low_latency"_a = true, "max_recv_tokens"_a = 0, "max_recv_rows"_a = 0, "expert_alignment"_a = 1,
            "team"_a = nb::none())
        .def_prop_ro("num_local_experts", [](const PyEpBuffer& b) { return b.use()->geometry().local_experts(); })
        .def_prop_ro("max_recv_rows", [](const PyEpBuffer& b) { return b.use()->geometry().max_recv_rows; })
        .def_prop_ro("closed", [](const PyEpBuffer& b) { return b.s->buffer.closed(); })
        .def("close", &PyEpBuffer::close)
        .def(
            "make_normal_handle",
            [](PyEpBuffer& b) {
                const auto buffer = b.use();  // held until the handle is counted: close() waits for it
                DeviceScope scope(b.s->device);  // outside the call: a handle made despite an interrupt dies there
                std::unique_ptr<ep::NormalHandle> made = interruptible(
                    b.h.get(), [&] { return std::make_unique<ep::NormalHandle>(buffer->make_normal_handle()); });
                return new PyNormalHandle(b.h, b.s, std::move(made), "ep.NormalHandle");
            },
            nb::rv_policy::take_ownership)
        .def(
            "make_low_latency_handle",
            [](PyEpBuffer& b) {
                const auto buffer = b.use();  // held until the handle is counted: close() waits for it
                // It allocates and waits on the Buffer's own stream; outside the call, so a handle made despite an
                // interrupt is destroyed on that device too.
                DeviceScope scope(b.s->device);
                std::unique_ptr<ep::LowLatencyHandle> made = interruptible(b.h.get(), [&] {
                    return std::make_unique<ep::LowLatencyHandle>(buffer->make_low_latency_handle());
                });
                return new PyLowLatencyHandle(b.h, b.s, std::move(made), "ep.LowLatencyHandle");
            },
            nb::rv_policy::take_ownership)
        .def("dispatch",
             interruptibly([](PyEpBuffer& b, PyNormalHandle& h, const TensorView& x, const TensorView& topk_idx,
                              const TensorView& topk_weights, uintptr_t stream, int num_sms) {
                 ep::NormalOptions o;
                 o.num_sms = num_sms;
                 DeviceScope scope(b.s->device);
                 b.use()->dispatch(*h.use(), x, topk_idx, topk_weights, as_stream(stream), o);
             }),
             "handle"_a, "x"_a, "topk_idx"_a, "topk_weights"_a, "stream"_a, "num_sms"_a = 0)
        .def("combine",
             interruptibly([](PyEpBuffer& b, PyNormalHandle& h, const TensorView& y, const TensorView& out,
                              uintptr_t stream, int num_sms) {
                 ep::NormalOptions o;
                 o.num_sms = num_sms;
                 DeviceScope scope(b.s->device);
                 b.use()->combine(*h.use(), y, out, as_stream(stream), o);
             }),
             "handle"_a, "y"_a, "out"_a, "stream"_a, "num_sms"_a = 0)
        .def("low_latency_dispatch",
             interruptibly([](PyEpBuffer& b, PyLowLatencyHandle& h, const TensorView& x, const TensorView& topk_idx,
                              uintptr_t stream, bool fp8, const std::string& phase, int num_sms) {
                 ep::LowLatencyOptions o;
                 o.fp8 = fp8;
                 o.phase = parse_phase(phase);
                 o.num_sms = num_sms;
                 DeviceScope scope(b.s->device);
                 b.use()->low_latency_dispatch(*h.use(), x, topk_idx, as_stream(stream), o);
             }),
             "handle"_a, "x"_a, "topk_idx"_a, "stream"_a, "fp8"_a = false, "phase"_a = "send_recv", "num_sms"_a = 0)
        .def("low_latency_combine",
             interruptibly([](PyEpBuffer& b, PyLowLatencyHandle& h, const TensorView& y, const TensorView& topk_idx,
                              const TensorView& topk_weights, const TensorView& out, uintptr_t stream,
                              const std::string& phase, int num_sms) {
                 ep::LowLatencyOptions o;
                 o.phase = parse_phase(phase);
                 o.num_sms = num_sms;
                 DeviceScope scope(b.s->device);
                 b.use()->low_latency_combine(*h.use(), y, topk_idx, topk_weights, out, as_stream(stream), o);
             }),
             "handle"_a, "y"_a, "topk_idx"_a, "topk_weights"_a, "out"_a, "stream"_a, "phase"_a = "send_recv",
             "num_sms"_a = 0)
        .def("check", [](const PyEpBuffer& b) { b.use()->check(); })
        .def("sync_and_check", interruptibly([](PyEpBuffer& b, uintptr_t stream) {
                 DeviceScope scope(b.s->device);
                 b.use()->sync_and_check(as_stream(stream));
             }));
    nb::class_<PyMoeBlock>(sub, "MoeBlock")
        .def(
            "__init__",
            [](PyMoeBlock* self, PyWorld& w, int num_experts, int hidden, int topk, int max_tokens_per_rank, int ffn,
               int64_t max_recv_tokens, int64_t max_recv_rows, const PyTeam* team) {
                ep::MoeConfig c;
                c.ep.num_experts = num_experts;
                c.ep.hidden = hidden;
                c.ep.topk = topk;
                c.ep.max_tokens_per_rank = max_tokens_per_rank;
                c.ep.low_latency = false;
                c.ep.max_recv_tokens = max_recv_tokens;
                c.ep.max_recv_rows = max_recv_rows;
                c.ffn = ffn;
                const WorldUse world = w.use();      // held until the block is counted: World.close() waits for it
                DeviceScope scope(world->device());  // its memory, stream and kernels on the World's GPU
                std::unique_ptr<ep::MoeBlock> block = interruptible(w.h.get(), [&] {
                    return team != nullptr ? std::make_unique<ep::MoeBlock>(team->get(&w.h), c)
                                           : std::make_unique<ep::MoeBlock>(*world, c);
                });
                new (self) PyMoeBlock(w.h, world->device(), std::move(block), "ep.MoeBlock");
            },
            "world"_a, "num_experts"_a, "hidden"_a, "topk"_a, "max_tokens_per_rank"_a, "ffn"_a, "max_recv_tokens"_a = 0,
            "max_recv_rows"_a = 0, "team"_a = nb::none())
        .def("forward",
             interruptibly([](PyMoeBlock& b, const TensorView& x, const TensorView& topk_idx,
                              const TensorView& topk_weights, const TensorView& gate_up, const TensorView& down,
                              const TensorView& out, uintptr_t stream, bool fused, int comm_sms) {
                 const auto use = b.use();
                 ep::MoeOptions o;
                 o.fused = fused;
                 o.comm_sms = comm_sms;
                 DeviceScope scope(b.device);
                 use->forward(x, topk_idx, topk_weights, ep::MoeWeights{gate_up, down}, out, as_stream(stream), o);
             }),
             "x"_a, "topk_idx"_a, "topk_weights"_a, "gate_up"_a, "down"_a, "out"_a, "stream"_a, "fused"_a = true,
             "comm_sms"_a = 0)
        .def_prop_ro("num_local_experts",
                     [](const PyMoeBlock& b) { return b.use()->buffer().geometry().local_experts(); })
        .def_prop_ro("max_recv_rows", [](const PyMoeBlock& b) { return b.use()->plan().max_recv_rows; })
        .def_prop_ro("up_config", [](const PyMoeBlock& b) { return ops::gemm_candidate_name(b.use()->plan().up); })
        .def_prop_ro("down_config", [](const PyMoeBlock& b) { return ops::gemm_candidate_name(b.use()->plan().down); })
        .def_prop_ro("expert_counts",
                     [](const PyMoeBlock& b) {
                         const auto block = b.use();
                         return int32_vector(block->handle().expert_counts(),
                                             block->buffer().geometry().local_experts());
                     })
        .def_prop_ro("expert_offsets",
                     [](const PyMoeBlock& b) {
                         const auto block = b.use();
                         return int32_vector(block->handle().expert_offsets(),
                                             block->buffer().geometry().local_experts() + 1);
                     })
        .def_prop_ro("gate_up_out", [](const PyMoeBlock& b) { return b.use()->gate_up_out(); })
        .def_prop_ro("activation", [](const PyMoeBlock& b) { return b.use()->activation(); })
        .def_prop_ro("expert_out", [](const PyMoeBlock& b) { return b.use()->expert_out(); })
        .def_prop_ro("closed", [](const PyMoeBlock& b) { return b.op.closed(); })
        .def("close", &PyMoeBlock::close)
        .def("check", [](const PyMoeBlock& b) { b.use()->check(); })
        .def("sync_and_check", interruptibly([](PyMoeBlock& b, uintptr_t stream) {
                 const auto use = b.use();
                 DeviceScope scope(b.device);
                 use->sync_and_check(as_stream(stream));
             }));
}

}  // namespace weft::python
