// SPDX-License-Identifier: MIT
// Rank-level runtime checks shared by the gpu and dist tiers (see runtime_checks.hpp).
#include "support/runtime_checks.hpp"

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "support/error_text.hpp"
#include "weft/weft.hpp"

namespace weft::test {

namespace {
// The test binaries that link these checks select eager module loading before main, i.e. before gtest's
// first test makes a CUDA call (run_local's own call would come too late for the process).
[[maybe_unused]] const bool kCudaEnvironment = (prepare_cuda_environment(), true);
}  // namespace

void time_failure(const std::function<void()>& call, double* seconds) {
    const auto start = std::chrono::steady_clock::now();
    try {
        call();
    } catch (...) {
        if (seconds != nullptr) {
            *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        }
        throw;
    }
}

void exit_with_fault_report(const std::string& message, double seconds, bool ok, bool skip_destructors) {
    std::fprintf(stderr, "error after %.3f s: %s\n", seconds, message.c_str());
    if (ok) std::fprintf(stderr, "the error named the missing rank\n");
    std::fflush(stderr);
    if (skip_destructors) std::_Exit(ok ? 0 : 1);
    std::exit(ok ? 0 : 1);
}

WorldOptions test_options(uint64_t heap_bytes) {
    WorldOptions o;
    o.heap_bytes = heap_bytes;
    o.timeout = std::chrono::milliseconds(30000);
    return o;
}

void run_ranks(int num_ranks, const std::function<void(World&)>& fn) { run_ranks(num_ranks, fn, test_options()); }

std::vector<std::string> error_of_each_rank(int num_ranks, const std::function<void(World&)>& fn) {
    std::mutex mutex;
    std::vector<std::string> errors(static_cast<size_t>(num_ranks));
    run_ranks(num_ranks, [&](World& w) {
        try {
            fn(w);
        } catch (const Error& e) {
            const std::lock_guard<std::mutex> lock(mutex);
            errors[static_cast<size_t>(w.rank())] = e.what();
        }
        w.barrier();
    });
    return errors;
}

void run_ranks(int num_ranks, const std::function<void(World&)>& fn, const WorldOptions& options) {
    try {
        run_local(num_ranks, fn, options);
    } catch (const std::exception& e) {
        ADD_FAILURE() << "run_local(" << num_ranks << ") failed: " << e.what();
    }
}

void check_exchange_through_symm_at(World& w, uint64_t count) {
    const int n = w.num_ranks();
    const int me = w.rank();
    SymmetricHeap& heap = w.heap();
    auto* buf = heap.alloc_array<uint32_t>(count * static_cast<uint64_t>(n));
    const size_t slot_bytes = count * sizeof(uint32_t);
    WEFT_CUDA_CHECK(cudaMemset(buf, 0xAB, slot_bytes * static_cast<size_t>(n)));  // poison
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    w.barrier();  // nobody writes into a buffer before its owner poisoned it
    std::vector<uint32_t> out(count);
    for (int d = 0; d < n; ++d) {
        for (uint64_t i = 0; i < count; ++i) out[i] = exchange_pattern(me, d, i);
        void* dst = heap.symm_at(static_cast<void*>(buf + static_cast<uint64_t>(me) * count), d);
        WEFT_CHECK(dst != nullptr, "rank " << me << ": symm_at gave nullptr for rank " << d
                                           << " (every rank of this host should be reachable)");
        WEFT_CUDA_CHECK(cudaMemcpy(dst, out.data(), slot_bytes, cudaMemcpyHostToDevice));
    }
    // cudaMemcpy from pageable memory may return before the copy lands: finish it before the barrier.
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    w.barrier();
    std::vector<uint32_t> in(count * static_cast<uint64_t>(n));
    WEFT_CUDA_CHECK(cudaMemcpy(in.data(), buf, in.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
    for (int s = 0; s < n; ++s) {
        uint64_t bad = 0, first_bad = 0;
        for (uint64_t i = 0; i < count; ++i) {
            if (in[static_cast<uint64_t>(s) * count + i] != exchange_pattern(s, me, i) && bad++ == 0) first_bad = i;
        }
        WEFT_CHECK(bad == 0, "rank " << me << ": " << bad << " of " << count << " elements from rank " << s
                                     << " are wrong; first at " << first_bad << ": got "
                                     << in[static_cast<uint64_t>(s) * count + first_bad] << ", expected "
                                     << exchange_pattern(s, me, first_bad));
    }
    w.barrier();  // everyone has verified before the buffer is freed and reused
    heap.free(buf);
}

namespace {
// A store key unique to this call: every rank makes the same sequence of calls, so the counters agree
// (one thread per rank: run_local's threads are fresh for each run, and a process is one rank).
std::string fresh_key(const char* what) {
    thread_local uint64_t counter = 0;
    return std::string("test/") + what + "/" + std::to_string(counter++);
}
}  // namespace

void check_alloc_free_cycles(World& w, int steps) {
    // Rank 0 picks the seed; every rank replays the same call sequence from it.
    uint32_t seed = std::random_device{}();
    Bytes blob(4);
    std::memcpy(blob.data(), &seed, 4);
    auto seeds = w.store().all_gather(fresh_key("seed"), w.rank(), w.num_ranks(), blob, w.timeout());
    std::memcpy(&seed, seeds[0].data(), 4);
    std::mt19937 rng(seed);
    SymmetricHeap& heap = w.heap();
    std::vector<uint8_t*> live;
    std::vector<uint64_t> offsets;
    // Earlier users of this World (e.g. the collectives' workspace, a World extension) may hold memory.
    const uint64_t in_use_before = heap.bytes_in_use();
    for (int step = 0; step < steps; ++step) {
        if (!live.empty() && rng() % 100 < 45) {
            const size_t k = rng() % live.size();
            heap.free(live[k]);
            live.erase(live.begin() + static_cast<long>(k));
        } else {
            const uint64_t bytes = 1 + rng() % (rng() % 5 == 0 ? (1u << 20) : 5000u);
            const uint64_t align = 1ull << (rng() % 13);
            auto* p = static_cast<uint8_t*>(heap.alloc(bytes, align));
            WEFT_CHECK(reinterpret_cast<uintptr_t>(p) % align == 0,
                       "seed " << seed << " step " << step << ": misaligned allocation");
            WEFT_CHECK(heap.contains(p, bytes), "seed " << seed << " step " << step << ": allocation outside the heap");
            live.push_back(p);
            offsets.push_back(heap.offset_of(p));
        }
    }
    for (auto* p : live) heap.free(p);
    WEFT_CHECK(heap.bytes_in_use() == in_use_before, "bytes in use after freeing everything: " << heap.bytes_in_use()
                                                                                       << ", before: " << in_use_before);
    Bytes mine(offsets.size() * 8);
    std::memcpy(mine.data(), offsets.data(), mine.size());
    auto all = w.store().all_gather(fresh_key("offsets"), w.rank(), w.num_ranks(), mine, w.timeout());
    for (int r = 0; r < w.num_ranks(); ++r) {
        WEFT_CHECK(all[static_cast<size_t>(r)] == mine,
                   "seed " << seed << ": rank " << r << "'s offsets differ from rank " << w.rank() << "'s");
    }
}

namespace {
using testing::error_of;
}  // namespace

void check_mismatch_errors(World& w) {
    const int n = w.num_ranks();
    const int me = w.rank();
    WEFT_CHECK(n >= 2, "check_mismatch_errors needs at least 2 ranks");
    SymmetricHeap& heap = w.heap();
    // Earlier users of this World (e.g. the collectives' workspace) may hold memory.
    const uint64_t in_use_before = heap.bytes_in_use();
    // Sizes: the last rank asks 8192 bytes, the others 4096.
    const std::string sizes = error_of([&] { heap.alloc(me == n - 1 ? 8192 : 4096); });
    std::string others = n == 2 ? "rank 0" : "ranks 0";
    for (int r = 1; r < n - 1; ++r) others += ", " + std::to_string(r);
    for (const std::string& part : {std::string("differs across ranks"), others + " asked alloc(4096 bytes, align 256)",
                                    "rank " + std::to_string(n - 1) + " asked alloc(8192 bytes, align 256)"}) {
        WEFT_CHECK(sizes.find(part) != std::string::npos,
                   "rank " << me << ": the size mismatch message lacks '" << part << "': '" << sizes << "'");
    }
    // The heap stays consistent: a matching call works (at offset 0 when nothing else is live).
    void* p = heap.alloc(4096);
    WEFT_CHECK(in_use_before != 0 || heap.offset_of(p) == 0,
               "rank " << me << ": offset after a mismatch is " << heap.offset_of(p));
    const std::string freed = "rank 0 asked free(offset " + std::to_string(heap.offset_of(p)) + ")";
    const std::string align = error_of([&] { heap.alloc(4096, me == 0 ? 512 : 256); });
    WEFT_CHECK(align.find("rank 0 asked alloc(4096 bytes, align 512)") != std::string::npos,
               "rank " << me << ": alignment mismatch message: '" << align << "'");
    const std::string kind = error_of([&] {
        if (me == 0) {
            heap.free(p);
        } else {
            heap.alloc(64);
        }
    });
    WEFT_CHECK(kind.find(freed) != std::string::npos,
               "rank " << me << ": alloc/free mismatch message: '" << kind << "'");
    // alloc_signals meets its peers again after zeroing: an alloc of the same bytes beside it is a mismatch too.
    const std::string signals = error_of([&] {
        if (me == 0) {
            (void)heap.alloc_signals(4);
        } else {
            (void)heap.alloc(32);
        }
    });
    WEFT_CHECK(signals.find("rank 0 asked alloc_signals(4 words)") != std::string::npos,
               "rank " << me << ": alloc_signals/alloc mismatch message: '" << signals << "'");
    heap.free(p);
    WEFT_CHECK(heap.bytes_in_use() == in_use_before,
               "rank " << me << ": heap holds more after the mismatch checks than before them");
}

void check_alloc_signals_zeroed(World& w) {
    SymmetricHeap& heap = w.heap();
    void* dirty = heap.alloc(1 << 16);
    WEFT_CUDA_CHECK(cudaMemset(dirty, 0xFF, 1 << 16));
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    heap.free(dirty);
    uint64_t* signals = heap.alloc_signals(777);
    WEFT_CHECK(static_cast<void*>(signals) == dirty, "first fit should reuse the dirty block");
    std::vector<uint64_t> host(777, 1);
    WEFT_CUDA_CHECK(cudaMemcpy(host.data(), signals, host.size() * 8, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < host.size(); ++i) WEFT_CHECK(host[i] == 0, "signal " << i << " is " << host[i]);
    heap.free(signals);
}

void check_stream_writes_to_peers(World& w) {
    SymmetricHeap& heap = w.heap();
    const int n = w.num_ranks();
    uint64_t* signals = heap.alloc_signals(static_cast<uint64_t>(n));
    uint32_t* words = heap.alloc_array<uint32_t>(static_cast<uint64_t>(n));
    cudaStream_t stream = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int d = 0; d < n; ++d) {
        stream_write_u64(stream, heap.symm_at(signals + w.rank(), d), 1000ull + static_cast<uint64_t>(w.rank()));
        stream_write_u32(stream, heap.symm_at(words + w.rank(), d), 77u + static_cast<uint32_t>(w.rank()));
    }
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    w.barrier();
    // Every peer's write has landed, so waiting for the values passes at once.
    for (int s = 0; s < n; ++s) {
        stream_wait_u64_geq(stream, signals + s, 1000ull + static_cast<uint64_t>(s));
        stream_wait_u32_geq(stream, words + s, 77u + static_cast<uint32_t>(s));
    }
    Event start(/*timing=*/true), done(/*timing=*/true);
    start.record(stream);
    done.record(stream);
    done.synchronize();
    WEFT_CHECK(done.query() && done.elapsed_ms(start) >= 0.0f, "event after the waits");
    std::vector<uint64_t> got(static_cast<size_t>(n));
    std::vector<uint32_t> got32(static_cast<size_t>(n));
    WEFT_CUDA_CHECK(cudaMemcpy(got.data(), signals, got.size() * 8, cudaMemcpyDeviceToHost));
    WEFT_CUDA_CHECK(cudaMemcpy(got32.data(), words, got32.size() * 4, cudaMemcpyDeviceToHost));
    for (int s = 0; s < n; ++s) {
        WEFT_CHECK(got[static_cast<size_t>(s)] == 1000ull + static_cast<uint64_t>(s) &&
                       got32[static_cast<size_t>(s)] == 77u + static_cast<uint32_t>(s),
                   "rank " << w.rank() << ": values from rank " << s << " are " << got[static_cast<size_t>(s)] << ", "
                           << got32[static_cast<size_t>(s)]);
    }
    const std::string misaligned = error_of(
        [&] { stream_write_u64(stream, reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(signals) + 4), 1); });
    WEFT_CHECK(misaligned.find("8-byte aligned") != std::string::npos, "misaligned write: '" << misaligned << "'");
    WEFT_CUDA_CHECK(cudaStreamDestroy(stream));
    w.barrier();
    heap.free(words);
    heap.free(signals);
}

}  // namespace weft::test
