// SPDX-License-Identifier: MIT
// What ranks sharing a GPU (threads of one process, one CUDA context) rely on: a kernel launched on one
// stream while a kernel of another stream spins waiting for it must start. Each probe launches a bounded
// spinner on one stream, then (optionally) makes one host call, then launches the kernel the spinner waits
// for on another stream, and reports whether the host call waited for the spinner and whether the spinner
// saw its flag. Nothing here hangs: the spinner gives up after kSpinTimeoutNs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr unsigned long long kSpinTimeoutNs = 300ull * 1000 * 1000;

__device__ unsigned long long probe_globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One thread: waits until *flag == want (outcome 1) or the timeout passes (outcome 2).
__global__ void probe_spin_until(const volatile unsigned* flag, unsigned want, unsigned* outcome) {
    const unsigned long long start = probe_globaltimer();
    while (*flag != want) {
        if (probe_globaltimer() - start > kSpinTimeoutNs) {
            *outcome = 2;
            return;
        }
        __nanosleep(1000);
    }
    *outcome = 1;
}

__global__ void probe_set_flag(volatile unsigned* flag, unsigned value) {
    __threadfence();
    *flag = value;
}

__global__ void probe_noop() {}

#define PROBE_CHECK(call)                                                                       \
    do {                                                                                        \
        const cudaError_t e_ = (call);                                                          \
        ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_);                  \
    } while (0)

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

struct ProbeResult {
    bool saw_flag = false;
    double host_call_ms = 0;
};

// Spinner on `spin_on`, then host_call(), then the setter on `set_on`; both streams synchronised after.
void probe(cudaStream_t spin_on, cudaStream_t set_on, const std::function<void()>& host_call, unsigned want,
           ProbeResult* r) {
    unsigned* flag = nullptr;
    unsigned* outcome = nullptr;
    PROBE_CHECK(cudaMalloc(&flag, sizeof(unsigned)));
    PROBE_CHECK(cudaMalloc(&outcome, sizeof(unsigned)));
    PROBE_CHECK(cudaMemset(flag, 0, sizeof(unsigned)));
    PROBE_CHECK(cudaMemset(outcome, 0, sizeof(unsigned)));
    PROBE_CHECK(cudaDeviceSynchronize());
    probe_spin_until<<<1, 1, 0, spin_on>>>(flag, want, outcome);
    PROBE_CHECK(cudaGetLastError());
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the spinner is running
    const auto t0 = std::chrono::steady_clock::now();
    if (host_call) host_call();
    r->host_call_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    probe_set_flag<<<1, 1, 0, set_on>>>(flag, want);
    PROBE_CHECK(cudaGetLastError());
    PROBE_CHECK(cudaDeviceSynchronize());
    unsigned got = 0;
    PROBE_CHECK(cudaMemcpy(&got, outcome, sizeof(unsigned), cudaMemcpyDeviceToHost));
    r->saw_flag = got == 1;
    PROBE_CHECK(cudaFree(flag));
    PROBE_CHECK(cudaFree(outcome));
}

// weft's ops on a shared GPU (run_local) need this: a rank's spinning kernel never holds back another
// stream's launch. Stream 0 runs the spinner, each other stream in turn the setter. The first 32 streams
// (CUDA_DEVICE_MAX_CONNECTIONS = 32 hardware queues, set by weft before CUDA starts) must all pass; 8 more
// are probed and printed (where a 33rd stream lands tells how streams are dealt to queues).
TEST(SharedGpuProbe, AKernelOnAnotherStreamStartsWhileOneSpins) {
    if (!have_gpu()) GTEST_SKIP() << "SKIPPED: no GPU";
    constexpr size_t kQueues = 32;
    std::vector<cudaStream_t> streams(kQueues + 8);
    for (auto& s : streams) PROBE_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::string missed, missed_beyond;
    for (size_t j = 1; j < streams.size(); ++j) {
        ProbeResult r;
        probe(streams[0], streams[j], nullptr, static_cast<unsigned>(j), &r);
        if (!r.saw_flag) (j < kQueues ? missed : missed_beyond) += " " + std::to_string(j);
    }
    for (auto& s : streams) PROBE_CHECK(cudaStreamDestroy(s));
    std::printf("[ PROBE    ] streams (creation order after stream 0) whose kernel did not start while stream 0's "
                "spun: first %zu:%s; beyond:%s\n",
                kQueues, missed.empty() ? " none" : missed.c_str(), missed_beyond.empty() ? " none" : missed_beyond.c_str());
    EXPECT_TRUE(missed.empty()) << "the setter on these streams did not start while stream 0's kernel spun:" << missed;
}

// Which host calls wait for a kernel spinning on another stream (CUDA's implicit synchronisation): each row
// is printed (host time, whether the spinner saw its flag). A rank that makes such a call while a peer's kernel
// spins for it deadlocks until the spin's timeout. Checked: the probe itself works (no call: seen, quick), and
// every call that returned before the spinner's timeout let it see its flag (consistent results).
TEST(SharedGpuProbe, HostCallsThatWaitForASpinningKernel) {
    if (!have_gpu()) GTEST_SKIP() << "SKIPPED: no GPU";
    cudaStream_t a = nullptr, b = nullptr, c = nullptr;
    PROBE_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    PROBE_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    PROBE_CHECK(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
    void* spare = nullptr;
    void* spare2 = nullptr;
    PROBE_CHECK(cudaMalloc(&spare, 64 << 20));
    PROBE_CHECK(cudaMalloc(&spare2, 64 << 20));
    cudaGraph_t graph = nullptr;
    PROBE_CHECK(cudaStreamBeginCapture(c, cudaStreamCaptureModeThreadLocal));
    probe_noop<<<1, 1, 0, c>>>();
    PROBE_CHECK(cudaStreamEndCapture(c, &graph));

    struct Call {
        const char* name;
        std::function<void()> run;
    };
    std::vector<void*> to_free;
    std::string err;  // the first failing CUDA call of a row's host call
    const auto ok = [&err](cudaError_t e) {
        if (e != cudaSuccess && err.empty()) err = cudaGetErrorString(e);
    };
    static std::vector<char> pageable(1 << 20);
    const std::vector<Call> calls = {
        {"(none)", nullptr},
        {"cudaMalloc 1 MiB", [&] { void* p = nullptr; ok(cudaMalloc(&p, 1 << 20)); to_free.push_back(p); }},
        {"cudaMalloc 256 MiB", [&] { void* p = nullptr; ok(cudaMalloc(&p, 256 << 20)); to_free.push_back(p); }},
        {"cudaMallocAsync 1 MiB on a third stream",
         [&] { void* p = nullptr; ok(cudaMallocAsync(&p, 1 << 20, c)); ok(cudaFreeAsync(p, c)); }},
        {"cudaMemset (legacy stream)", [&] { ok(cudaMemset(spare, 0, 1 << 20)); }},
        {"cudaMemsetAsync on a third stream", [&] { ok(cudaMemsetAsync(spare, 0, 1 << 20, c)); }},
        {"cudaMemcpyAsync D2D on a third stream",
         [&] { ok(cudaMemcpyAsync(spare2, spare, 1 << 20, cudaMemcpyDeviceToDevice, c)); }},
        {"cudaMemcpyAsync H2D pageable on a third stream",
         [&] { ok(cudaMemcpyAsync(spare, pageable.data(), pageable.size(), cudaMemcpyHostToDevice, c)); }},
        {"cudaHostAlloc 1 MiB + cudaFreeHost",
         [&] { void* p = nullptr; ok(cudaHostAlloc(&p, 1 << 20, cudaHostAllocDefault)); ok(cudaFreeHost(p)); }},
        {"cudaGraphInstantiate", [&] { cudaGraphExec_t e = nullptr; ok(cudaGraphInstantiate(&e, graph, 0)); ok(cudaGraphExecDestroy(e)); }},
        {"cudaStreamCreate + Destroy",
         [&] { cudaStream_t s = nullptr; ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); ok(cudaStreamDestroy(s)); }},
        {"cudaEventCreate + Destroy", [&] { cudaEvent_t e = nullptr; ok(cudaEventCreate(&e)); ok(cudaEventDestroy(e)); }},
        {"cudaFuncSetAttribute",
         [&] { ok(cudaFuncSetAttribute(probe_noop, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 << 10)); }},
        {"a kernel on the legacy stream", [&] { probe_noop<<<1, 1>>>(); ok(cudaGetLastError()); }},
        {"cudaFree", [&] { for (void* p : to_free) ok(cudaFree(p)); to_free.clear(); }},
    };
    std::printf("[ PROBE    ] host call while a kernel of another stream spins   host ms  spinner saw its flag\n");
    int consistent = 0;
    for (const Call& call : calls) {
        ProbeResult r;
        err.clear();
        probe(a, b, call.run, 7u, &r);
        EXPECT_TRUE(err.empty()) << call.name << ": " << err;
        const bool waited = r.host_call_ms * 1e6 > 0.8 * static_cast<double>(kSpinTimeoutNs);
        std::printf("[ PROBE    ] %-50s %8.2f  %s%s\n", call.name, r.host_call_ms, r.saw_flag ? "yes" : "NO",
                    waited ? " (the call waited for the spinner)" : "");
        if (call.run == nullptr) {
            EXPECT_TRUE(r.saw_flag) << "the probe itself: a setter on another stream did not reach the spinner";
            EXPECT_LT(r.host_call_ms, 1.0);
        }
        if (!waited) {
            EXPECT_TRUE(r.saw_flag) << call.name << " returned in " << r.host_call_ms
                                    << " ms, yet the spinner never saw its flag";
        }
        consistent += !waited || !r.saw_flag;
    }
    EXPECT_EQ(consistent, static_cast<int>(calls.size()));
    for (void* p : to_free) cudaFree(p);
    PROBE_CHECK(cudaGraphDestroy(graph));
    PROBE_CHECK(cudaFree(spare));
    PROBE_CHECK(cudaFree(spare2));
    PROBE_CHECK(cudaStreamDestroy(a));
    PROBE_CHECK(cudaStreamDestroy(b));
    PROBE_CHECK(cudaStreamDestroy(c));
}

}  // namespace
