// SPDX-License-Identifier: MIT
// weft._weft: the Python binding of weft's runtime and ops (nanobind). Tensors cross as TensorViews built from raw
// device pointers, shapes, strides and dtype codes, and streams as integers (cudaStream_t), so the extension has no
// dependency on PyTorch; python/weft converts torch tensors. Every call that may block, meet other ranks or launch
// work runs with the GIL released (the store adapter takes it back for its Python calls); those that wait for other
// ranks run as interruptible calls (binding.hpp: Ctrl-C ends them).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "binding.hpp"
#include "weft/ops/ag_attention.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/attention.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/team.hpp"
#include "weft/weft.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace weft::python {

namespace {

DType as_dtype(int code) {
    WEFT_CHECK(code >= static_cast<int>(DType::kBF16) && code <= static_cast<int>(DType::kU8),
               "dtype: expected a weft dtype code in [0, 6], got " << code);
    return static_cast<DType>(code);
}

TensorView make_view(uintptr_t ptr, int dtype, const std::vector<int64_t>& shape,
                     const std::vector<int64_t>& strides) {
    WEFT_CHECK(!shape.empty() && shape.size() <= static_cast<size_t>(TensorView::kMaxDims),
               "shape: expected 1 to " << TensorView::kMaxDims << " dimensions, got " << shape.size());
    WEFT_CHECK(strides.size() == shape.size(),
               "strides: expected " << shape.size() << " strides (one per dimension), got " << strides.size());
    TensorView v;
    v.data = reinterpret_cast<void*>(ptr);
    v.dtype = as_dtype(dtype);
    v.ndim = static_cast<int32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) {
        WEFT_CHECK(shape[i] >= 0, "shape: dimension " << i << " is negative (" << shape[i] << ")");
        v.shape[i] = shape[i];
        v.strides[i] = strides[i];
    }
    return v;
}

// A contiguous 1-D view of `numel` elements: the collectives' form from the Python wrappers (python/weft/_ops.py).
TensorView flat_view(uintptr_t ptr, int dtype, int64_t numel) {
    WEFT_CHECK(numel >= 0, "numel: expected a non-negative element count, got " << numel);
    return TensorView(reinterpret_cast<void*>(ptr), as_dtype(dtype), {numel});
}

/// The team a collective call runs on: `team`'s (refused when it is another World's) or, for none, the World's own.
const Team& team_of(PyWorld& w, const WorldUse& world, const PyTeam* team) {
    return team != nullptr ? team->get(&w.h) : world->team();
}

/// A collective binding's body: the World in use (World.close() waits for it) and its GPU current, the algorithm
/// code as the op's Options, then run(team, options).
template <class Options, class Run>
void run_collective(PyWorld& w, const PyTeam* team, int algo, Run&& run) {
    const WorldUse world = w.use();
    DeviceScope scope(world->device());
    Options o;
    o.algo = static_cast<decltype(o.algo)>(algo);
    run(team_of(w, world, team), o);
}

/// decode_attention's (and sp_decode_attention's) options from the bindings' arguments; `status` a contiguous int32 [4]
/// tensor (the record's four fields in order), refused otherwise.
ops::DecodeAttentionOptions decode_options(std::optional<float> scale, int num_splits,
                                           const std::optional<TensorView>& workspace,
                                           const std::optional<TensorView>& status) {
    ops::DecodeAttentionOptions o;
    o.scale = scale;
    o.num_splits = num_splits;
    if (workspace) o.workspace = *workspace;
    o.status = status_record<ops::AttentionStatus>(status, "weft.attention_status()");
    return o;
}

/// The device pointer of a grouped GEMM's per-group array (`name`: offsets or counts), refused unless `v` is a
/// contiguous int32 [G] with G = b's groups (a b that is not 3-D is left to the op, whose message names it). The
/// wrapper (python/weft/_moe.py) checks the same before the call.
const int32_t* group_array(const TensorView& v, const TensorView& b, const char* name) {
    WEFT_CHECK(v.dtype == DType::kI32 && v.ndim == 1 && (v.dim(0) <= 1 || v.stride(0) == 1),
               name << ": expected a contiguous 1-D int32 tensor (one value per group), got " << v.describe());
    WEFT_CHECK(b.ndim != 3 || v.dim(0) == b.dim(0),
               name << ": expected " << b.dim(0) << " values (one per group: b's first extent), got " << v.describe());
    return static_cast<const int32_t*>(v.data);
}

std::vector<int64_t> dims(const std::array<int64_t, TensorView::kMaxDims>& values, int32_t ndim) {
    return std::vector<int64_t>(values.begin(), values.begin() + ndim);
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
    std::vector<int64_t> strides(shape.size(), 1);
    for (size_t i = shape.size(); i-- > 1;) strides[i - 1] = strides[i] * shape[i];
    return strides;
}

struct PyStoreAdapter {
    std::shared_ptr<Store> store;
};

using PyAgGemm = PyOp<ops::AgGemm>;
using PyGemmRs = PyOp<ops::GemmRs>;
using PyGemmAr = PyOp<ops::GemmAr>;
using PyAgAttention = PyOp<ops::AgAttention>;

WorldOptions make_options(int device, uint64_t heap_bytes, int sm_budget, int64_t timeout_ms) {
    WorldOptions o;
    o.device = device;
    o.heap_bytes = heap_bytes;
    o.sm_budget = sm_budget;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    return o;
}

ops::GemmRsMode parse_gemm_rs_mode(const std::string& mode) {
    if (mode == "auto") return ops::GemmRsMode::kAuto;
    if (mode == "pull") return ops::GemmRsMode::kPull;
    if (mode == "push") return ops::GemmRsMode::kPush;
    WEFT_FAIL("mode: expected 'auto', 'pull' or 'push', got '" << mode << "'");
}

std::optional<DType> optional_dtype(std::optional<int> code) {
    if (!code) return std::nullopt;
    return as_dtype(*code);
}

nb::bytes to_bytes(const Bytes& b) { return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size()); }

Bytes from_bytes(const nb::bytes& b) {
    const auto* p = static_cast<const uint8_t*>(b.data());
    return Bytes(p, p + b.size());
}

}  // namespace

BLayout as_b_layout(int code) {
    WEFT_CHECK(code == static_cast<int>(BLayout::kNK) || code == static_cast<int>(BLayout::kKN),
               "b_layout: expected 0 (nk) or 1 (kn), got " << code);
    return static_cast<BLayout>(code);
}

ops::GroupedGemmOptions grouped_options(int sm_budget, int64_t expected_rows_per_group,
                                        const std::optional<TensorView>& status) {
    ops::GroupedGemmOptions o;
    o.sm_budget = sm_budget;
    o.expected_rows_per_group = expected_rows_per_group;
    o.status = status_record<ops::GroupedStatus>(status, "weft.grouped_status()");
    return o;
}

}  // namespace weft::python

NB_MODULE(_weft, m) {
    using namespace weft;
    using namespace weft::python;
    using Release = nb::call_guard<nb::gil_scoped_release>;

    m.doc() = "weft's C++ runtime and ops (use the Python package weft, which converts torch tensors)";
    nb::exception<weft::Error>(m, "Error", PyExc_RuntimeError);
    m.attr("__version__") = WEFT_VERSION_STRING;
    install_process_hooks();
    bind_ep(m);
    bind_moe(m);
    bind_testing(m);

    nb::dict dtypes;
    for (DType t : {DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kI32, DType::kI64, DType::kU8}) {
        dtypes[dtype_name(t)] = static_cast<int>(t);
    }
    m.attr("DTYPES") = dtypes;
    m.def("dtype_bytes", [](int code) { return dtype_bytes(as_dtype(code)); });
    m.def("cuda_available", [] { return cuda_available(); }, Release());
    // weft.init / weft.finalize call it first, before their lock: from a signal handler inside a weft wait they are
    // refused as every binding is (init would wait for the lock the interrupted init holds).
    m.def("refuse_inside_signal_handler", [](const std::string& who) { refuse_inside_signal_handler(who.c_str()); });

    // ---- tensors ----
    nb::class_<TensorView>(m, "TensorView")
        .def("__init__",
             [](TensorView* self, uintptr_t ptr, int dtype, const std::vector<int64_t>& shape,
                const std::optional<std::vector<int64_t>>& strides) {
                 new (self) TensorView(make_view(ptr, dtype, shape, strides ? *strides : contiguous_strides(shape)));
             },
             "ptr"_a, "dtype"_a, "shape"_a, "strides"_a = nb::none())
        .def_prop_ro("ptr", [](const TensorView& v) { return reinterpret_cast<uintptr_t>(v.data); })
        .def_prop_ro("dtype", [](const TensorView& v) { return static_cast<int>(v.dtype); })
        .def_prop_ro("shape", [](const TensorView& v) { return dims(v.shape, v.ndim); })
        .def_prop_ro("strides", [](const TensorView& v) { return dims(v.strides, v.ndim); })
        .def("numel", &TensorView::numel)
        .def("is_contiguous", &TensorView::is_contiguous)
        .def("__repr__", [](const TensorView& v) { return "TensorView(" + v.describe() + ")"; });
    m.def("dlpack", [](const TensorView& view, int device) { return make_dlpack_capsule(view, device); }, "view"_a,
          "device"_a, "A DLPack capsule over `view` on CUDA device `device` (the memory stays weft's).");

    // ---- stores ----
    nb::class_<PyStoreAdapter>(m, "StoreAdapter")
        .def(
            "__init__",
            [](PyStoreAdapter* self, nb::object store, const std::optional<std::string>& prefix) {
                std::shared_ptr<Store> s = std::make_shared<PythonStore>(std::move(store));
                if (prefix) s = make_prefix_store(std::move(s), *prefix);
                new (self) PyStoreAdapter{std::move(s)};
            },
            "store"_a.none(), "prefix"_a = nb::none())
        .def("set",
             [](PyStoreAdapter& a, const std::string& key, const nb::bytes& value) {
                 Bytes v = from_bytes(value);
                 interruptible(nullptr, [&] { a.store->set(key, v); });
             })
        .def("get",
             [](PyStoreAdapter& a, const std::string& key, int64_t timeout_ms) {
                 return to_bytes(
                     interruptible(nullptr, [&] { return a.store->get(key, std::chrono::milliseconds(timeout_ms)); }));
             })
        .def("add", interruptibly([](PyStoreAdapter& a, const std::string& key, int64_t delta) {
                 return a.store->add(key, delta);
             }))
        .def("check", interruptibly([](PyStoreAdapter& a, const std::string& key) { return a.store->check(key); }))
        .def("erase", interruptibly([](PyStoreAdapter& a, const std::string& key) { a.store->erase(key); }))
        .def("barrier",
             [](PyStoreAdapter& a, const std::string& name, int rank, int num_ranks, int64_t timeout_ms) {
                 interruptible(nullptr,
                               [&] { a.store->barrier(name, rank, num_ranks, std::chrono::milliseconds(timeout_ms)); });
             })
        .def("all_gather", [](PyStoreAdapter& a, const std::string& name, int rank, int num_ranks,
                              const nb::bytes& blob, int64_t timeout_ms) {
            Bytes mine = from_bytes(blob);
            const std::vector<Bytes> all = interruptible(nullptr, [&] {
                return a.store->all_gather(name, rank, num_ranks, mine, std::chrono::milliseconds(timeout_ms));
            });
            nb::list out;
            for (const Bytes& b : all) out.append(to_bytes(b));
            return out;
        });

    // ---- World ----
    nb::class_<PyWorld>(m, "World")
        .def_static(
            "from_env",
            [](int device, uint64_t heap_bytes, int sm_budget, int64_t timeout_ms) {
                return new PyWorld(interruptible(
                    nullptr, [&] { return World::from_env(make_options(device, heap_bytes, sm_budget, timeout_ms)); }));
            },
            "device"_a = -1, "heap_bytes"_a = 0, "sm_budget"_a = 0, "timeout_ms"_a = 0, nb::rv_policy::take_ownership)
        .def_static(
            "from_store",
            [](const PyStoreAdapter& store, int rank, int num_ranks, int local_rank, int local_num_ranks,
               const std::string& key_prefix, int device, uint64_t heap_bytes, int sm_budget, int64_t timeout_ms,
               int64_t dead_peer_ms) {
                WEFT_CHECK(dead_peer_ms >= 0,
                           "World.from_store: dead_peer_ms must be >= 0 (0: WEFT_DEAD_PEER_MS, else "
                           "10 s), got "
                               << dead_peer_ms);
                WorldMembership membership;
                membership.rank = rank;
                membership.num_ranks = num_ranks;
                membership.local_rank = local_rank;
                membership.local_num_ranks = local_num_ranks;
                membership.key_prefix = key_prefix;
                WorldOptions options = make_options(device, heap_bytes, sm_budget, timeout_ms);
                options.dead_peer_timeout = std::chrono::milliseconds(dead_peer_ms);
                return new PyWorld(
                    interruptible(nullptr, [&] { return World::from_store(store.store, membership, options); }));
            },
            "store"_a, "rank"_a, "num_ranks"_a, "local_rank"_a = -1, "local_num_ranks"_a = 0, "key_prefix"_a = "weft",
            "device"_a = -1, "heap_bytes"_a = 0, "sm_budget"_a = 0, "timeout_ms"_a = 0, "dead_peer_ms"_a = 0,
            nb::rv_policy::take_ownership)
        .def("close", [](PyWorld& w) { interruptible<true>(w.h.get(), [&] { w.close(); }); })
        // abort is let in while the World closes (it ends the calls in flight that close() waits for), and from a
        // signal handler that runs inside a weft call (all such a handler may do: binding.hpp).
        .def(
            "abort",
            [](PyWorld& w, const std::string& reason) {
                const WorldUse world = w.use(Admit::kOpenOrClosing);
                // Its store calls may be interrupted.
                interruptible<false, FromSignalHandler::kAllow>(w.h.get(), [&] { world->abort(reason); });
            },
            "reason"_a)
        .def_prop_ro("aborted",
                     [](const PyWorld& w) { return !w.h->world.closed() && w.use(Admit::kOpenOrClosing)->aborted(); })
        .def_prop_ro("closed", [](const PyWorld& w) { return w.h->world.closed(); })
        .def_prop_ro("live_objects", [](const PyWorld& w) { return w.h->live_objects; })
        .def_prop_ro("rank", [](const PyWorld& w) { return w.use()->rank(); })
        .def_prop_ro("num_ranks", [](const PyWorld& w) { return w.use()->num_ranks(); })
        .def_prop_ro("local_rank", [](const PyWorld& w) { return w.use()->local_rank(); })
        .def_prop_ro("local_num_ranks", [](const PyWorld& w) { return w.use()->local_num_ranks(); })
        .def_prop_ro("device", [](const PyWorld& w) { return w.use()->device(); })
        .def_prop_ro("sm_budget", [](const PyWorld& w) { return w.use()->sm_budget(); })
        .def_prop_ro("num_ranks_on_device", [](const PyWorld& w) { return w.use()->num_ranks_on_device(); })
        .def_prop_ro("timeout_ms", [](const PyWorld& w) { return static_cast<int64_t>(w.use()->timeout().count()); })
        .def("barrier", [](PyWorld& w) { interruptible(w.h.get(), [&] { w.use()->barrier(); }); })
        .def("sync_and_check",
             interruptibly([](PyWorld& w, uintptr_t stream) { w.use()->sync_and_check(as_stream(stream)); }),
             "stream"_a)
        .def("check_diagnostics", [](PyWorld& w) { w.use()->check_diagnostics(); })
        // The symmetric heap (collective alloc and free: every rank, same arguments, same order).
        .def(
            "alloc",
            [](PyWorld& w, uint64_t bytes, uint64_t align) {
                return interruptible(w.h.get(),
                                     [&] { return reinterpret_cast<uintptr_t>(w.use()->heap().alloc(bytes, align)); });
            },
            "bytes"_a, "align"_a = 256)
        .def(
            "free",
            [](PyWorld& w, uintptr_t ptr) {
                interruptible(w.h.get(), [&] { w.use()->heap().free(reinterpret_cast<void*>(ptr)); });
            },
            "ptr"_a)
        .def(
            "heap_contains",
            [](const PyWorld& w, uintptr_t ptr, uint64_t bytes) {
                return w.use()->heap().contains(reinterpret_cast<const void*>(ptr), bytes);
            },
            "ptr"_a, "bytes"_a = 1)
        .def_prop_ro("heap_bytes", [](const PyWorld& w) { return w.use()->heap().bytes(); })
        .def_prop_ro("heap_bytes_in_use", [](const PyWorld& w) { return w.use()->heap().bytes_in_use(); })
        .def("team",
             [](PyWorld& w) {
                 return PyTeam{w.h, w.use()->team()};
             })
        .def("node_team",
             [](PyWorld& w) {
                 return PyTeam{w.h, w.use()->node_team()};
             })
        .def("prepare_collectives", [](PyWorld& w) {
            const ops::CollectiveWorkspaceInfo info = interruptible(w.h.get(), [&] {
                const WorldUse world = w.use();
                DeviceScope scope(world->device());  // the workspace's streams and events on the World's GPU
                return ops::prepare_collectives(*world);
            });
            nb::dict d;
            d["num_ranks"] = info.topology.num_ranks;
            d["max_ranks_per_gpu"] = info.topology.max_ranks_per_gpu;
            d["grid_budget"] = info.topology.grid_budget;
            d["heap_bytes"] = info.heap_bytes;
            d["num_kernels"] = info.num_kernels;
            return d;
        });

    nb::class_<PyTeam>(m, "Team")
        .def_prop_ro("id", [](const PyTeam& t) { return t.team.id(); })
        .def_prop_ro("is_world", [](const PyTeam& t) { return t.team.is_world(); })
        .def("barrier",
             [](const PyTeam& t) {
                 interruptible(t.h.get(), [&] {
                     const WorldUse world = t.use();
                     t.get().barrier();
                 });
             })
        .def(
            "alloc",
            [](const PyTeam& t, uint64_t bytes, uint64_t align) {
                return interruptible(t.h.get(), [&] {
                    return reinterpret_cast<uintptr_t>(t.use()->heap().alloc(t.get(), bytes, align));
                });
            },
            "bytes"_a, "align"_a = 256)
        .def(
            "free",
            [](const PyTeam& t, uintptr_t ptr) {
                interruptible(t.h.get(), [&] { t.use()->heap().free(t.get(), reinterpret_cast<void*>(ptr)); });
            },
            "ptr"_a)
        .def_prop_ro("rank", [](const PyTeam& t) { return t.team.rank(); })
        .def_prop_ro("num_ranks", [](const PyTeam& t) { return t.team.num_ranks(); })
        .def_prop_ro("is_member", [](const PyTeam& t) { return t.team.is_member(); })
        .def_prop_ro("members", [](const PyTeam& t) { return t.team.members(); })
        .def("world_rank", [](const PyTeam& t, int r) { return t.team.world_rank(r); })
        .def("team_rank", [](const PyTeam& t, int r) { return t.team.team_rank(r); })
        .def("split_strided",
             [](const PyTeam& t, int start, int stride, int size) {
                 const WorldUse world = t.use();
                 return PyTeam{t.h, t.get().split_strided(start, stride, size)};
             })
        .def("split_color", [](const PyTeam& t, int color, int key) {
            const WorldUse world = t.use();
            return PyTeam{t.h, interruptible(t.h.get(), [&] { return t.get().split_color(color, key); })};
        });

    // ---- collectives (stream: a cudaStream_t as an integer) ----
    // Each on the World's GPU (whatever the calling thread's) and on `team` (None: the World's own), in two forms:
    // TensorViews, and contiguous buffers given as a data pointer and an element count (the Python wrappers' form: no
    // TensorView object is made per call).
    m.def("all_reduce",
          interruptibly([](PyWorld& w, const TensorView& input, const TensorView& output, uintptr_t stream, int algo,
                           const PyTeam* team) {
              run_collective<ops::AllReduceOptions>(w, team, algo, [&](const Team& t, const auto& o) {
                  ops::all_reduce(t, input, output, as_stream(stream), o);
              });
          }),
          "world"_a, "input"_a, "output"_a, "stream"_a, "algo"_a = 0, "team"_a = nb::none());
    m.def("all_gather",
          interruptibly([](PyWorld& w, const TensorView& input, const TensorView& output, uintptr_t stream, int algo,
                           const PyTeam* team) {
              run_collective<ops::AllGatherOptions>(w, team, algo, [&](const Team& t, const auto& o) {
                  ops::all_gather(t, input, output, as_stream(stream), o);
              });
          }),
          "world"_a, "input"_a, "output"_a, "stream"_a, "algo"_a = 0, "team"_a = nb::none());
    m.def("reduce_scatter",
          interruptibly([](PyWorld& w, const TensorView& input, const TensorView& output, uintptr_t stream, int algo,
                           const PyTeam* team) {
              run_collective<ops::ReduceScatterOptions>(w, team, algo, [&](const Team& t, const auto& o) {
                  ops::reduce_scatter(t, input, output, as_stream(stream), o);
              });
          }),
          "world"_a, "input"_a, "output"_a, "stream"_a, "algo"_a = 0, "team"_a = nb::none());
    m.def(
        "count_refused_collective_call",
        [](PyWorld& w, const PyTeam* team) {
            const WorldUse world = w.use();
            ops::count_refused_collective_call(team_of(w, world, team));
        },
        "world"_a, "team"_a = nb::none());
    m.def("all_reduce_flat",
          interruptibly([](PyWorld& w, uintptr_t input, uintptr_t output, int64_t numel, int dtype, uintptr_t stream,
                           int algo, const PyTeam* team) {
              run_collective<ops::AllReduceOptions>(w, team, algo, [&](const Team& t, const auto& o) {
                  ops::all_reduce(t, flat_view(input, dtype, numel), flat_view(output, dtype, numel), as_stream(stream),
                                  o);
              });
          }),
          "world"_a, "input"_a, "output"_a, "numel"_a, "dtype"_a, "stream"_a, "algo"_a = 0, "team"_a = nb::none());
    m.def("all_gather_flat",
          interruptibly([](PyWorld& w, uintptr_t input, int64_t input_numel, uintptr_t output, int64_t output_numel,
                           int dtype, uintptr_t stream, int algo, const PyTeam* team) {
              run_collective<ops::AllGatherOptions>(w, team, algo, [&](const Team& t, const auto& o) {
                  ops::all_gather(t, flat_view(input, dtype, input_numel), flat_view(output, dtype, output_numel),
                                  as_stream(stream), o);
              });
          }),
          "world"_a, "input"_a, "input_numel"_a, "output"_a, "output_numel"_a, "dtype"_a, "stream"_a, "algo"_a = 0,
          "team"_a = nb::none());
    m.def("reduce_scatter_flat",
          interruptibly([](PyWorld& w, uintptr_t input, int64_t input_numel, uintptr_t output, int64_t output_numel,
                           int dtype, uintptr_t stream, int algo, const PyTeam* team) {
              run_collective<ops::ReduceScatterOptions>(w, team, algo, [&](const Team& t, const auto& o) {
                  ops::reduce_scatter(t, flat_view(input, dtype, input_numel), flat_view(output, dtype, output_numel),
                                      as_stream(stream), o);
              });
          }),
          "world"_a, "input"_a, "input_numel"_a, "output"_a, "output_numel"_a, "dtype"_a, "stream"_a, "algo"_a = 0,
          "team"_a = nb::none());
    m.def("all_to_all_flat",
          interruptibly([](PyWorld& w, uintptr_t input, uintptr_t output, int64_t numel, int dtype, uintptr_t stream,
                           const PyTeam* team) {
              const WorldUse world = w.use();
              DeviceScope scope(world->device());
              ops::all_to_all(team_of(w, world, team), flat_view(input, dtype, numel), flat_view(output, dtype, numel),
                              as_stream(stream));
          }),
          "world"_a, "input"_a, "output"_a, "numel"_a, "dtype"_a, "stream"_a, "team"_a = nb::none());
    m.def("all_to_all_v_flat",
          interruptibly([](PyWorld& w, uintptr_t input, int64_t input_numel, const std::vector<int64_t>& send_counts,
                           uintptr_t output, int64_t output_numel, const std::vector<int64_t>& recv_counts, int dtype,
                           uintptr_t stream, const PyTeam* team) {
              const WorldUse world = w.use();
              DeviceScope scope(world->device());
              ops::all_to_all_v(team_of(w, world, team), flat_view(input, dtype, input_numel), send_counts,
                                flat_view(output, dtype, output_numel), recv_counts, as_stream(stream));
          }),
          "world"_a, "input"_a, "input_numel"_a, "send_counts"_a, "output"_a, "output_numel"_a, "recv_counts"_a,
          "dtype"_a, "stream"_a, "team"_a = nb::none());
    m.def("ulysses",
          interruptibly([](PyWorld& w, const TensorView& input, const TensorView& output, const TensorView& scratch,
                           bool seq_to_head, uintptr_t stream, const PyTeam* team) {
              const WorldUse world = w.use();
              DeviceScope scope(world->device());
              const Team& t = team_of(w, world, team);
              if (seq_to_head) {
                  ops::ulysses_seq_to_head(t, input, output, scratch, as_stream(stream));
              } else {
                  ops::ulysses_head_to_seq(t, input, output, scratch, as_stream(stream));
              }
          }),
          "world"_a, "input"_a, "output"_a, "scratch"_a, "seq_to_head"_a, "stream"_a, "team"_a = nb::none());
    // Benchmark support: `iters` back-to-back all_reduce calls made from C++ (no Python between them); returns the
    // host seconds they took, the floor the Python layers are measured against (bench/python/bench_overhead.py).
    m.def("time_all_reduce_calls",
          interruptibly([](PyWorld& w, const TensorView& input, const TensorView& output, uintptr_t stream, int iters) {
              WEFT_CHECK(iters > 0, "iters: expected a positive count, got " << iters);
              const WorldUse world = w.use();
              const auto start = std::chrono::steady_clock::now();
              for (int i = 0; i < iters; ++i) ops::all_reduce(*world, input, output, as_stream(stream));
              return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          }),
          "world"_a, "input"_a, "output"_a, "stream"_a, "iters"_a);
    m.def("parse_algo", [](const std::string& op, const std::string& name) -> int {
        std::optional<int> code;
        if (op == "all_reduce") {
            if (auto a = ops::parse_all_reduce_algo(name)) code = static_cast<int>(*a);
        } else if (op == "all_gather") {
            if (auto a = ops::parse_all_gather_algo(name)) code = static_cast<int>(*a);
        } else if (op == "reduce_scatter") {
            if (auto a = ops::parse_reduce_scatter_algo(name)) code = static_cast<int>(*a);
        } else {
            WEFT_FAIL("op: expected 'all_reduce', 'all_gather' or 'reduce_scatter', got '" << op << "'");
        }
        WEFT_CHECK(code.has_value(), "algo: '" << name << "' is not an algorithm of " << op);
        return *code;
    }, "op"_a, "name"_a);

    // ---- GEMM ----
    m.def(
        "gemm",
        [](const TensorView& a, const TensorView& b, const TensorView& d, int b_layout, int device, uintptr_t stream) {
            const BLayout layout = as_b_layout(b_layout);
            // The tensors' device, whatever the calling thread's current one (another Python thread's is 0).
            DeviceScope scope(device);
            ops::gemm(a, b, d, layout, as_stream(stream));
        },
        "a"_a, "b"_a, "d"_a, "b_layout"_a, "device"_a, "stream"_a, Release());

    // ---- grouped GEMM (MoE experts; local ops: one GPU, no World needed) ----
    // offsets, counts and status: int32 tensors on the tensors' device, read (status: written) by the kernel.
    m.def(
        "grouped_gemm_contiguous",
        [](const TensorView& a, const TensorView& b, const TensorView& d, int b_layout, const TensorView& offsets,
           const TensorView& counts, int device, uintptr_t stream, int sm_budget, int64_t expected_rows_per_group,
           const std::optional<TensorView>& status) {
            const BLayout layout = as_b_layout(b_layout);
            const int32_t* offsets_ptr = group_array(offsets, b, "offsets");
            const int32_t* counts_ptr = group_array(counts, b, "counts");
            const ops::GroupedGemmOptions o = grouped_options(sm_budget, expected_rows_per_group, status);
            DeviceScope scope(device);
            ops::grouped_gemm_contiguous(a, b, d, layout, offsets_ptr, counts_ptr, as_stream(stream), o);
        },
        "a"_a, "b"_a, "d"_a, "b_layout"_a, "offsets"_a, "counts"_a, "device"_a, "stream"_a, "sm_budget"_a = 0,
        "expected_rows_per_group"_a = 0, "status"_a = nb::none(), Release());
    m.def(
        "grouped_gemm_masked",
        [](const TensorView& a, const TensorView& b, const TensorView& d, int b_layout, const TensorView& counts,
           int device, uintptr_t stream, int sm_budget, int64_t expected_rows_per_group,
           const std::optional<TensorView>& status) {
            const BLayout layout = as_b_layout(b_layout);
            const int32_t* counts_ptr = group_array(counts, b, "counts");
            const ops::GroupedGemmOptions o = grouped_options(sm_budget, expected_rows_per_group, status);
            DeviceScope scope(device);
            ops::grouped_gemm_masked(a, b, d, layout, counts_ptr, as_stream(stream), o);
        },
        "a"_a, "b"_a, "d"_a, "b_layout"_a, "counts"_a, "device"_a, "stream"_a, "sm_budget"_a = 0,
        "expected_rows_per_group"_a = 0, "status"_a = nb::none(), Release());
    m.def(
        "grouped_gemm_masked_fp8",
        [](const TensorView& a, const TensorView& a_scales, const TensorView& b, const TensorView& d, int b_layout,
           const TensorView& counts, const TensorView& a_bf16, int device, uintptr_t stream, int sm_budget,
           int64_t expected_rows_per_group, const std::optional<TensorView>& status) {
            const BLayout layout = as_b_layout(b_layout);
            const int32_t* counts_ptr = group_array(counts, b, "counts");
            const ops::GroupedGemmOptions o = grouped_options(sm_budget, expected_rows_per_group, status);
            DeviceScope scope(device);
            ops::grouped_gemm_masked_fp8(a, a_scales, b, d, layout, counts_ptr, a_bf16, as_stream(stream), o);
        },
        "a"_a, "a_scales"_a, "b"_a, "d"_a, "b_layout"_a, "counts"_a, "a_bf16"_a, "device"_a, "stream"_a,
        "sm_budget"_a = 0, "expected_rows_per_group"_a = 0, "status"_a = nb::none(), Release());
    m.def(
        "describe_grouped_status",
        [](int32_t code, int32_t group, int32_t value, int32_t limit) {
            return ops::describe_grouped_status(ops::GroupedStatus{code, group, value, limit});
        },
        "code"_a, "group"_a, "value"_a, "limit"_a);

    // ---- attention (local ops: one GPU, no World needed) ----
    m.def(
        "flash_attention",
        [](const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
           const std::optional<TensorView>& lse, int device, uintptr_t stream, bool causal, std::optional<float> scale,
           int64_t q_position) {
            DeviceScope scope(device);
            ops::FlashAttentionOptions o;
            o.mask = causal ? AttentionMask::kCausal : AttentionMask::kNone;
            o.scale = scale;
            o.q_position = q_position;
            ops::flash_attention(q, k, v, out, lse ? *lse : TensorView(), as_stream(stream), o);
        },
        "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(), "device"_a, "stream"_a, "causal"_a, "scale"_a.none(),
        "q_position"_a, Release());
    m.def(
        "decode_attention",
        [](const TensorView& q, const TensorView& k_cache, const TensorView& v_cache, const TensorView& block_table,
           const TensorView& seq_lens, int64_t max_seq_len, const TensorView& out, const std::optional<TensorView>& lse,
           int device, uintptr_t stream, std::optional<float> scale, int num_splits,
           const std::optional<TensorView>& workspace, const std::optional<TensorView>& status) {
            const ops::DecodeAttentionOptions o = decode_options(scale, num_splits, workspace, status);
            DeviceScope scope(device);
            ops::decode_attention(q, k_cache, v_cache, block_table, seq_lens, max_seq_len, out,
                                  lse ? *lse : TensorView(), as_stream(stream), o);
        },
        "q"_a, "k_cache"_a, "v_cache"_a, "block_table"_a, "seq_lens"_a, "max_seq_len"_a, "out"_a, "lse"_a.none(),
        "device"_a, "stream"_a, "scale"_a.none(), "num_splits"_a, "workspace"_a.none(), "status"_a.none(), Release());
    // Sequence-parallel decode: a collective of the World (or a team), so it waits like one (interruptibly).
    m.def("sp_decode_attention",
          interruptibly([](PyWorld& w, const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                           const TensorView& block_table, const TensorView& seq_lens, int64_t max_seq_len,
                           const TensorView& out, const std::optional<TensorView>& lse, uintptr_t stream,
                           std::optional<float> scale, int num_splits, const std::optional<TensorView>& workspace,
                           const std::optional<TensorView>& status, const PyTeam* team) {
              const WorldUse world = w.use();
              DeviceScope scope(world->device());
              ops::sp_decode_attention(team_of(w, world, team), q, k_cache, v_cache, block_table, seq_lens, max_seq_len,
                                       out, lse ? *lse : TensorView(), as_stream(stream),
                                       decode_options(scale, num_splits, workspace, status));
          }),
          "world"_a, "q"_a, "k_cache"_a, "v_cache"_a, "block_table"_a, "seq_lens"_a, "max_seq_len"_a, "out"_a,
          "lse"_a.none(), "stream"_a, "scale"_a.none(), "num_splits"_a, "workspace"_a.none(), "status"_a.none(),
          "team"_a = nb::none());
    m.def(
        "describe_attention_status",
        [](int32_t code, int32_t sequence, int32_t page, int32_t value) {
            return ops::describe_attention_status(AttentionStatus{code, sequence, page, value});
        },
        "code"_a, "sequence"_a, "page"_a, "value"_a);
    m.def(
        "decode_attention_workspace_bytes",
        [](int64_t batch, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t max_seq_len,
           int num_splits, int device) {
            DeviceScope scope(device);
            ops::DecodeAttentionOptions o;
            o.num_splits = num_splits;
            return ops::decode_attention_workspace_bytes(batch, num_q_heads, num_kv_heads, head_dim, max_seq_len, o);
        },
        "batch"_a, "num_q_heads"_a, "num_kv_heads"_a, "head_dim"_a, "max_seq_len"_a, "num_splits"_a, "device"_a,
        Release());

    // ---- fused TP ops ----
    nb::class_<PyAgGemm>(m, "AgGemm")
        .def(
            "__init__",
            [](PyAgGemm* self, PyWorld& w, int64_t max_m, int64_t n, int64_t k, int dtype, int64_t chunk_rows,
               int copy_streams, int sm_budget, bool autotune, const PyTeam* team) {
                const WorldUse world = w.use();      // held until the op is counted: World.close() waits for it
                DeviceScope scope(world->device());  // the op's streams, events and memory on the World's GPU
                ops::AgGemmShape shape{max_m, n, k, as_dtype(dtype)};
                ops::AgGemmOptions o;
                o.chunk_rows = chunk_rows;
                o.copy_streams = copy_streams;
                o.sm_budget = sm_budget;
                o.autotune = autotune;
                std::unique_ptr<ops::AgGemm> op = interruptible(w.h.get(), [&] {
                    return team ? std::make_unique<ops::AgGemm>(team->get(&w.h), shape, o)
                                : std::make_unique<ops::AgGemm>(*world, shape, o);
                });
                new (self) PyAgGemm(w.h, world->device(), std::move(op), "AgGemm");
            },
            "world"_a, "max_m"_a, "n"_a, "k"_a, "dtype"_a, "chunk_rows"_a = 0, "copy_streams"_a = 0, "sm_budget"_a = 0,
            "autotune"_a = false, "team"_a = nb::none())
        .def("run", interruptibly([](PyAgGemm& op, const TensorView& a, const TensorView& b, const TensorView& c,
                                     uintptr_t stream) {
                 const auto use = op.use();
                 DeviceScope scope(op.device);
                 use->run(a, b, c, as_stream(stream));
             }))
        .def("gathered", [](const PyAgGemm& op, int64_t m) { return op.use()->gathered(m); })
        .def("local_shard", [](const PyAgGemm& op, int64_t m) { return op.use()->local_shard(m); })
        .def_prop_ro("max_m", [](const PyAgGemm& op) { return op.use()->shape().max_m; })
        .def_prop_ro("n", [](const PyAgGemm& op) { return op.use()->shape().n; })
        .def_prop_ro("k", [](const PyAgGemm& op) { return op.use()->shape().k; })
        .def_prop_ro("chunk_rows", [](const PyAgGemm& op) { return op.use()->chunk_rows(); })
        .def_prop_ro("closed", [](const PyAgGemm& op) { return op.op.closed(); })
        .def("close", &PyAgGemm::close);

    nb::class_<PyGemmRs>(m, "GemmRs")
        .def(
            "__init__",
            [](PyGemmRs* self, PyWorld& w, int64_t max_m, int64_t n, int64_t k, int dtype, const std::string& mode,
               std::optional<int> partial_dtype, int64_t chunk_rows, int reduce_ctas, int sm_budget, bool autotune,
               const PyTeam* team) {
                const WorldUse world = w.use();      // held until the op is counted: World.close() waits for it
                DeviceScope scope(world->device());  // the op's streams, events and memory on the World's GPU
                ops::GemmRsShape shape{max_m, n, k, as_dtype(dtype)};
                ops::GemmRsOptions o;
                o.mode = parse_gemm_rs_mode(mode);
                o.partial_dtype = optional_dtype(partial_dtype);
                o.chunk_rows = chunk_rows;
                o.reduce_ctas = reduce_ctas;
                o.sm_budget = sm_budget;
                o.autotune = autotune;
                std::unique_ptr<ops::GemmRs> op = interruptible(w.h.get(), [&] {
                    return team ? std::make_unique<ops::GemmRs>(team->get(&w.h), shape, o)
                                : std::make_unique<ops::GemmRs>(*world, shape, o);
                });
                new (self) PyGemmRs(w.h, world->device(), std::move(op), "GemmRs");
            },
            "world"_a, "max_m"_a, "n"_a, "k"_a, "dtype"_a, "mode"_a = "auto", "partial_dtype"_a = nb::none(),
            "chunk_rows"_a = 0, "reduce_ctas"_a = 0, "sm_budget"_a = 0, "autotune"_a = false, "team"_a = nb::none())
        .def("run", interruptibly([](PyGemmRs& op, const TensorView& a, const TensorView& b, const TensorView& c,
                                     uintptr_t stream) {
                 const auto use = op.use();
                 DeviceScope scope(op.device);
                 use->run(a, b, c, as_stream(stream));
             }))
        .def_prop_ro("max_m", [](const PyGemmRs& op) { return op.use()->shape().max_m; })
        .def_prop_ro("n", [](const PyGemmRs& op) { return op.use()->shape().n; })
        .def_prop_ro("k", [](const PyGemmRs& op) { return op.use()->shape().k; })
        .def_prop_ro("mode", [](const PyGemmRs& op) { return std::string(ops::gemm_rs_mode_name(op.use()->mode())); })
        .def_prop_ro("closed", [](const PyGemmRs& op) { return op.op.closed(); })
        .def("close", &PyGemmRs::close);

    nb::class_<PyGemmAr>(m, "GemmAr")
        .def(
            "__init__",
            [](PyGemmAr* self, PyWorld& w, int64_t max_m, int64_t n, int64_t k, int dtype,
               std::optional<int> partial_dtype, int reduce_ctas, int sm_budget, bool collective_all_reduce,
               const PyTeam* team) {
                const WorldUse world = w.use();      // held until the op is counted: World.close() waits for it
                DeviceScope scope(world->device());  // the op's streams, events and memory on the World's GPU
                ops::GemmArShape shape{max_m, n, k, as_dtype(dtype)};
                ops::GemmArOptions o;
                o.partial_dtype = optional_dtype(partial_dtype);
                o.reduce_ctas = reduce_ctas;
                o.sm_budget = sm_budget;
                o.collective_all_reduce = collective_all_reduce;
                std::unique_ptr<ops::GemmAr> op = interruptible(w.h.get(), [&] {
                    return team ? std::make_unique<ops::GemmAr>(team->get(&w.h), shape, o)
                                : std::make_unique<ops::GemmAr>(*world, shape, o);
                });
                new (self) PyGemmAr(w.h, world->device(), std::move(op), "GemmAr");
            },
            "world"_a, "max_m"_a, "n"_a, "k"_a, "dtype"_a, "partial_dtype"_a = nb::none(), "reduce_ctas"_a = 0,
            "sm_budget"_a = 0, "collective_all_reduce"_a = true, "team"_a = nb::none())
        .def("run", interruptibly([](PyGemmAr& op, const TensorView& a, const TensorView& b, const TensorView& c,
                                     uintptr_t stream) {
                 const auto use = op.use();
                 DeviceScope scope(op.device);
                 use->run(a, b, c, as_stream(stream));
             }))
        .def_prop_ro("max_m", [](const PyGemmAr& op) { return op.use()->shape().max_m; })
        .def_prop_ro("n", [](const PyGemmAr& op) { return op.use()->shape().n; })
        .def_prop_ro("k", [](const PyGemmAr& op) { return op.use()->shape().k; })
        .def_prop_ro("closed", [](const PyGemmAr& op) { return op.op.closed(); })
        .def("close", &PyGemmAr::close);

    nb::class_<PyAgAttention>(m, "AgAttention")
        .def(
            "__init__",
            [](PyAgAttention* self, PyWorld& w, int64_t max_seq, int64_t num_q_heads, int64_t num_kv_heads,
               int64_t head_dim, int dtype, bool causal, std::optional<float> scale, int sm_budget,
               const PyTeam* team) {
                const WorldUse world = w.use();      // held until the op is counted: World.close() waits for it
                DeviceScope scope(world->device());  // the op's streams, events and memory on the World's GPU
                ops::AgAttentionShape shape{max_seq,         num_q_heads,
                                            num_kv_heads,    head_dim,
                                            as_dtype(dtype), causal ? AttentionMask::kCausal : AttentionMask::kNone};
                ops::AgAttentionOptions o;
                o.scale = scale;
                o.sm_budget = sm_budget;
                std::unique_ptr<ops::AgAttention> op = interruptible(w.h.get(), [&] {
                    return team ? std::make_unique<ops::AgAttention>(team->get(&w.h), shape, o)
                                : std::make_unique<ops::AgAttention>(*world, shape, o);
                });
                new (self) PyAgAttention(w.h, world->device(), std::move(op), "AgAttention");
            },
            "world"_a, "max_seq"_a, "num_q_heads"_a, "num_kv_heads"_a, "head_dim"_a, "dtype"_a, "causal"_a = true,
            "scale"_a.none() = nb::none(), "sm_budget"_a = 0, "team"_a = nb::none())
        .def("run", interruptibly([](PyAgAttention& op, const TensorView& q, const TensorView& k, const TensorView& v,
                                     const TensorView& out, const std::optional<TensorView>& lse, uintptr_t stream) {
                 const auto use = op.use();
                 DeviceScope scope(op.device);
                 use->run(q, k, v, out, lse ? *lse : TensorView(), as_stream(stream));
             }))
        .def("gathered_k", [](const PyAgAttention& op, int64_t seq) { return op.use()->gathered_k(seq); })
        .def("gathered_v", [](const PyAgAttention& op, int64_t seq) { return op.use()->gathered_v(seq); })
        .def("local_k", [](const PyAgAttention& op, int64_t seq) { return op.use()->local_k(seq); })
        .def("local_v", [](const PyAgAttention& op, int64_t seq) { return op.use()->local_v(seq); })
        .def_prop_ro("closed", [](const PyAgAttention& op) { return op.op.closed(); })
        .def("close", &PyAgAttention::close);

    // CPU-only checks the ops run before they touch a GPU (tests and argument errors without a World).
    m.def("validate_ag_gemm_shape", [](int64_t max_m, int64_t n, int64_t k, int dtype, int num_ranks) {
        ops::validate_ag_gemm_shape({max_m, n, k, as_dtype(dtype)}, num_ranks);
    }, "max_m"_a, "n"_a, "k"_a, "dtype"_a, "num_ranks"_a);
    m.def("validate_gemm_rs_shape", [](int64_t max_m, int64_t n, int64_t k, int dtype, int num_ranks) {
        ops::validate_gemm_rs_shape({max_m, n, k, as_dtype(dtype)}, num_ranks);
    }, "max_m"_a, "n"_a, "k"_a, "dtype"_a, "num_ranks"_a);
    m.def("validate_gemm_ar_shape", [](int64_t max_m, int64_t n, int64_t k, int dtype, int num_ranks) {
        ops::validate_gemm_ar_shape({max_m, n, k, as_dtype(dtype)}, num_ranks);
    }, "max_m"_a, "n"_a, "k"_a, "dtype"_a, "num_ranks"_a);
}
