// SPDX-License-Identifier: MIT
// The binding of the tensor-parallel MoE layers (weft::ops::MoeAgGroupedGemm, MoeGroupedGemmRs) and of the gathered
// layout they share (moe_route, the gathered grouped GEMMs, moe_combine): a routing crosses as its four int32 arrays
// (views) and its sizes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>

#include "binding.hpp"
#include "weft/ops/moe_tp.hpp"
#include "weft/runtime/error.hpp"

namespace weft::python {

namespace {

using namespace nb::literals;

using PyMoeAgGroupedGemm = PyOp<ops::MoeAgGroupedGemm>;
using PyMoeGroupedGemmRs = PyOp<ops::MoeGroupedGemmRs>;

/// An int32 array of a routing: a contiguous 1-D view of `count` elements, else weft::Error naming it.
int32_t* routing_array(const TensorView& v, const char* name, int64_t count) {
    WEFT_CHECK(
        v.dtype == DType::kI32 && v.ndim == 1 && v.dim(0) == count && (count <= 1 || v.stride(0) == 1),
        "routing." << name << ": expected a contiguous int32 tensor of " << count << " elements, got " << v.describe());
    return static_cast<int32_t*>(v.data);
}

/// A MoeRouting over the caller's arrays: counts [E], offsets [E + 1], gather_index [rows_capacity], slot_rows
/// [tokens * topk]. The op that takes it checks the sizes against its own (moe_tp.cpp: check_routing).
ops::MoeRouting routing_of(const TensorView& counts, const TensorView& offsets, const TensorView& gather_index,
                           const TensorView& slot_rows, int64_t tokens, int64_t topk) {
    WEFT_CHECK(counts.ndim == 1, "routing.counts: expected a 1-D tensor, got " << counts.describe());
    WEFT_CHECK(gather_index.ndim == 1, "routing.gather_index: expected a 1-D tensor, got " << gather_index.describe());
    WEFT_CHECK(tokens >= 0 && tokens <= INT32_MAX && topk >= 0 && topk <= INT32_MAX,
               "routing: tokens and topk must be in [0, 2^31), got " << tokens << " and " << topk);
    ops::MoeRouting r;
    r.num_experts = counts.dim(0);
    r.rows_capacity = gather_index.dim(0);
    r.tokens = tokens;
    r.topk = topk;
    r.counts = routing_array(counts, "counts", r.num_experts);
    r.offsets = routing_array(offsets, "offsets", r.num_experts + 1);
    r.gather_index = routing_array(gather_index, "gather_index", r.rows_capacity);
    r.slot_rows = routing_array(slot_rows, "slot_rows", tokens * topk);
    return r;
}

/// The routing's arrays as views (counts, offsets, gather_index, slot_rows).
std::tuple<TensorView, TensorView, TensorView, TensorView> routing_views(const ops::MoeRouting& r) {
    return {TensorView(r.counts, DType::kI32, {r.num_experts}), TensorView(r.offsets, DType::kI32, {r.num_experts + 1}),
            TensorView(r.gather_index, DType::kI32, {r.rows_capacity}),
            TensorView(r.slot_rows, DType::kI32, {r.tokens * r.topk})};
}

ops::MoeTpShape moe_tp_shape(int64_t max_tokens, int64_t hidden, int64_t ffn, int64_t num_experts, int64_t topk) {
    return ops::MoeTpShape{max_tokens, hidden, ffn, num_experts, topk};
}

ops::MoeTpOptions moe_tp_options(int comm_blocks, int sm_budget, int64_t timeout_ms) {
    WEFT_CHECK(timeout_ms >= 0, "timeout_ms: expected >= 0 (0: the World's), got " << timeout_ms);
    ops::MoeTpOptions o;
    o.comm_blocks = comm_blocks;
    o.sm_budget = sm_budget;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    return o;
}

/// A TP MoE layer's class: made on a World (or a team of it) as the other fused ops' bindings make theirs, with
/// rows_capacity, closed and close(); the caller adds run().
template <class Op>
nb::class_<PyOp<Op>> bind_layer(nb::module_& m, const char* name) {
    return nb::class_<PyOp<Op>>(m, name)
        .def(
            "__init__",
            [name](PyOp<Op>* self, PyWorld& w, int64_t max_tokens, int64_t hidden, int64_t ffn, int64_t num_experts,
                   int64_t topk, int comm_blocks, int sm_budget, int64_t timeout_ms, const PyTeam* team) {
                const ops::MoeTpShape shape = moe_tp_shape(max_tokens, hidden, ffn, num_experts, topk);
                const ops::MoeTpOptions o = moe_tp_options(comm_blocks, sm_budget, timeout_ms);
                const WorldUse world = w.use();      // held until the op is counted: World.close() waits for it
                DeviceScope scope(world->device());  // the op's streams, events and memory on the World's GPU
                std::unique_ptr<Op> op = interruptible(w.h.get(), [&] {
                    return team ? std::make_unique<Op>(team->get(&w.h), shape, o)
                                : std::make_unique<Op>(*world, shape, o);
                });
                new (self) PyOp<Op>(w.h, world->device(), std::move(op), name);
            },
            "world"_a, "max_tokens"_a, "hidden"_a, "ffn"_a, "num_experts"_a, "topk"_a, "comm_blocks"_a = 0,
            "sm_budget"_a = 0, "timeout_ms"_a = 0, "team"_a = nb::none())
        .def_prop_ro("rows_capacity", [](const PyOp<Op>& op) { return op.use()->rows_capacity(); })
        .def_prop_ro("closed", [](const PyOp<Op>& op) { return op.op.closed(); })
        .def("close", &PyOp<Op>::close);
}

}  // namespace

void bind_moe(nb::module_& m) {
    m.def("moe_gathered_rows", &ops::moe_gathered_rows, "tokens"_a, "topk"_a, "num_experts"_a, "align"_a = 1);
    m.def(
        "moe_route",
        [](const TensorView& topk_idx, const TensorView& counts, const TensorView& offsets,
           const TensorView& gather_index, const TensorView& slot_rows, int64_t align,
           const std::optional<TensorView>& status, int device, uintptr_t stream) {
            WEFT_CHECK(topk_idx.ndim == 2,
                       "topk_idx: expected a 2-D tensor [tokens, topk], got " << topk_idx.describe());
            ops::MoeRouting r = routing_of(counts, offsets, gather_index, slot_rows, topk_idx.dim(0), topk_idx.dim(1));
            auto* record = status_record<ops::MoeRoutingStatus>(status, "weft.moe_routing_status()");
            DeviceScope scope(device);
            ops::moe_route(topk_idx, r, align, as_stream(stream), record);
        },
        "topk_idx"_a, "counts"_a, "offsets"_a, "gather_index"_a, "slot_rows"_a, "align"_a, "status"_a.none(),
        "device"_a, "stream"_a, nb::call_guard<nb::gil_scoped_release>());
    // The gathered layout's grouped GEMMs and combine (local ops: on `device`, on `stream`). A routing crosses as its
    // four arrays, the tokens and topk; the workspaces are the wrapper's (python/weft/_moe.py).
    m.def(
        "grouped_gemm_gathered",
        [](const TensorView& a, const TensorView& b, const TensorView& d, int b_layout, const TensorView& counts,
           const TensorView& offsets, const TensorView& gather_index, const TensorView& slot_rows, int64_t tokens,
           int64_t topk, const TensorView& a_rows, int device, uintptr_t stream, int sm_budget,
           int64_t expected_rows_per_group, const std::optional<TensorView>& status) {
            const BLayout layout = as_b_layout(b_layout);
            const ops::MoeRouting r = routing_of(counts, offsets, gather_index, slot_rows, tokens, topk);
            const ops::GroupedGemmOptions o = grouped_options(sm_budget, expected_rows_per_group, status);
            DeviceScope scope(device);
            ops::grouped_gemm_gathered(a, b, d, layout, r, a_rows, as_stream(stream), o);
        },
        "a"_a, "b"_a, "d"_a, "b_layout"_a, "counts"_a, "offsets"_a, "gather_index"_a, "slot_rows"_a, "tokens"_a,
        "topk"_a, "a_rows"_a, "device"_a, "stream"_a, "sm_budget"_a = 0, "expected_rows_per_group"_a = 0,
        "status"_a = nb::none(), nb::call_guard<nb::gil_scoped_release>());
    m.def(
        "grouped_gemm_gathered_combine",
        [](const TensorView& a, const TensorView& b, const TensorView& out, int b_layout, const TensorView& counts,
           const TensorView& offsets, const TensorView& gather_index, const TensorView& slot_rows, int64_t tokens,
           int64_t topk, bool weighted_sum, const std::optional<TensorView>& weights, const TensorView& a_rows,
           const TensorView& d_rows, int device, uintptr_t stream, int sm_budget, int64_t expected_rows_per_group,
           const std::optional<TensorView>& status) {
            const BLayout layout = as_b_layout(b_layout);
            const ops::MoeRouting r = routing_of(counts, offsets, gather_index, slot_rows, tokens, topk);
            const ops::GroupedGemmOptions o = grouped_options(sm_budget, expected_rows_per_group, status);
            DeviceScope scope(device);
            ops::grouped_gemm_gathered_combine(
                a, b, out, layout, r, weighted_sum ? ops::MoeCombineMode::kWeightedSum : ops::MoeCombineMode::kPerSlot,
                weights ? *weights : TensorView(), a_rows, d_rows, as_stream(stream), o);
        },
        "a"_a, "b"_a, "out"_a, "b_layout"_a, "counts"_a, "offsets"_a, "gather_index"_a, "slot_rows"_a, "tokens"_a,
        "topk"_a, "weighted_sum"_a, "weights"_a.none(), "a_rows"_a, "d_rows"_a, "device"_a, "stream"_a,
        "sm_budget"_a = 0, "expected_rows_per_group"_a = 0, "status"_a = nb::none(),
        nb::call_guard<nb::gil_scoped_release>());
    m.def(
        "moe_combine",
        [](const TensorView& d_rows, const TensorView& counts, const TensorView& offsets,
           const TensorView& gather_index, const TensorView& slot_rows, int64_t tokens, int64_t topk, bool weighted_sum,
           const std::optional<TensorView>& weights, const TensorView& out, int device, uintptr_t stream) {
            const ops::MoeRouting r = routing_of(counts, offsets, gather_index, slot_rows, tokens, topk);
            DeviceScope scope(device);
            ops::moe_combine(d_rows, r,
                             weighted_sum ? ops::MoeCombineMode::kWeightedSum : ops::MoeCombineMode::kPerSlot,
                             weights ? *weights : TensorView(), out, as_stream(stream));
        },
        "d_rows"_a, "counts"_a, "offsets"_a, "gather_index"_a, "slot_rows"_a, "tokens"_a, "topk"_a, "weighted_sum"_a,
        "weights"_a.none(), "out"_a, "device"_a, "stream"_a, nb::call_guard<nb::gil_scoped_release>());
    m.def(
        "describe_moe_routing_status",
        [](int32_t code, int32_t slot, int32_t value, int32_t limit) {
            return ops::describe_routing_status(ops::MoeRoutingStatus{code, slot, value, limit});
        },
        "code"_a, "slot"_a, "value"_a, "limit"_a);
    m.def(
        "validate_moe_tp_shape",
        [](int64_t max_tokens, int64_t hidden, int64_t ffn, int64_t num_experts, int64_t topk, int num_ranks,
           int comm_blocks, int sm_budget, int64_t timeout_ms, const std::string& op) {
            ops::validate_moe_tp_shape(moe_tp_shape(max_tokens, hidden, ffn, num_experts, topk), num_ranks,
                                       moe_tp_options(comm_blocks, sm_budget, timeout_ms), op.c_str());
        },
        "max_tokens"_a, "hidden"_a, "ffn"_a, "num_experts"_a, "topk"_a, "num_ranks"_a, "comm_blocks"_a = 0,
        "sm_budget"_a = 0, "timeout_ms"_a = 0, "op"_a = "MoeTp");

    bind_layer<ops::MoeAgGroupedGemm>(m, "MoeAgGroupedGemm")
        .def("run", interruptibly([](PyMoeAgGroupedGemm& op, const TensorView& x_local, const TensorView& topk_idx,
                                     const TensorView& w, const TensorView& y, uintptr_t stream) {
                 const auto use = op.use();
                 DeviceScope scope(op.device);
                 use->run(x_local, topk_idx, w, y, as_stream(stream));
             }))
        .def("routing", [](const PyMoeAgGroupedGemm& op) { return routing_views(op.use()->routing()); })
        .def("routing_status", [](const PyMoeAgGroupedGemm& op) {
            const ops::MoeRoutingStatus& s = op.use()->routing_status();
            return std::make_tuple(s.code, s.slot, s.value, s.limit);
        });

    bind_layer<ops::MoeGroupedGemmRs>(m, "MoeGroupedGemmRs")
        .def("run", interruptibly([](PyMoeGroupedGemmRs& op, const TensorView& h, const TensorView& w,
                                     const TensorView& counts, const TensorView& offsets,
                                     const TensorView& gather_index, const TensorView& slot_rows, int64_t tokens,
                                     int64_t topk, const TensorView& weights, const TensorView& out, uintptr_t stream) {
                 const auto use = op.use();
                 const ops::MoeRouting r = routing_of(counts, offsets, gather_index, slot_rows, tokens, topk);
                 DeviceScope scope(op.device);
                 use->run(h, w, r, weights, out, as_stream(stream));
             }));
}

}  // namespace weft::python
