// SPDX-License-Identifier: MIT
// weft_probe_shared_gpu: what ranks sharing a GPU (threads of one process, one CUDA context) rely on, measured on
// the machine at hand. A kernel launched on one stream while a kernel of another stream spins waiting for it must
// start; each probe launches a bounded spinner on one stream, optionally makes one host call, then launches the
// kernel the spinner waits for on another stream, and prints whether the spinner saw it. Nothing hangs: the
// spinner gives up after kSpinTimeoutNs. docs/runtime.md ("Shared GPUs and the runtime's own work") sums up what
// the probes found on an H200; run them again on a new driver or GPU.
//
//   weft_probe_shared_gpu [--probe streams|host-calls|local-memory|world|all]      (default all)
//
// Each probe runs in a fresh process (`all` starts one per probe): `local-memory` needs the context's first kernel
// with local memory, `world` the context's first kernel launch. The exit status is 1 when something weft relies on
// did not hold (the lines marked "UNEXPECTED"), 0 otherwise. With CUDA_DEVICE_MAX_CONNECTIONS below 8 (weft sets
// 32 unless told otherwise) streams share hardware queues and the stream probes expect nothing.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/cli.hpp"
#include "weft/weft.hpp"

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

// A kernel with kBytes of local memory per thread (a volatile array the compiler cannot keep in registers).
template <int kBytes>
__global__ void probe_local_memory(int i, int* out) {
    volatile int a[kBytes / 4];
    for (int k = 0; k < kBytes / 4; k += 64) a[k] = k + i;
    out[threadIdx.x] = a[(i * 64) % (kBytes / 4)];
}

// Every block of call c of every rank: block 0 arrives (+1 on *arrive); thread 0 of every block waits until all
// ranks arrived (so the blocks hold their SMs as a persistent GEMM's do), bounded; a timeout counts in *failed.
__global__ void probe_rank_call(unsigned* arrive, unsigned ranks, unsigned* failed) {
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0) atomicAdd(arrive, 1u);
    const unsigned long long start = probe_globaltimer();
    while (*static_cast<volatile unsigned*>(arrive) < ranks) {
        if (probe_globaltimer() - start > 500ull * 1000 * 1000) {
            atomicAdd(failed, 1u);
            return;
        }
        __nanosleep(500);
    }
}

#define PROBE_CUDA(call) WEFT_CUDA_CHECK(call)

// Expectations: a failed one is printed and makes the exit status 1.
int g_unexpected = 0;
void expect(bool ok, const std::string& what) {
    if (ok) return;
    ++g_unexpected;
    std::printf("  UNEXPECTED: %s\n", what.c_str());
}

// The hardware queues this process asked for: the stream probes expect streams apart only with at least 8.
int connections() {
    const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    return v != nullptr ? std::atoi(v) : 8;
}

struct ProbeResult {
    bool saw_flag = false;
    double host_call_ms = 0;
};

// What probe() queues behind the spinner on its own stream, where streams share a hardware queue in front of
// everything queued after it, the setter included.
enum class Behind {
    kNothing,
    kKernel,  // a kernel (waits for the spinner)
    kCopies,  // a 1 MiB device-to-device copy and a stream write (as the copy-engine all-gather queued them), and a
              // 1 MiB copy ahead of the setter on its stream (as a peer's staging copy or result download)
};

// Spinner on `spin_on`, then host_call(), then the setter on `set_on`; both streams synchronised after; `behind`: what
// else is queued (Behind).
ProbeResult probe(cudaStream_t spin_on, cudaStream_t set_on, const std::function<void()>& host_call, unsigned want,
                  Behind behind = Behind::kNothing) {
    unsigned* flag = nullptr;
    unsigned* outcome = nullptr;
    PROBE_CUDA(cudaMalloc(&flag, sizeof(unsigned)));
    PROBE_CUDA(cudaMalloc(&outcome, sizeof(unsigned)));
    PROBE_CUDA(cudaMemset(flag, 0, sizeof(unsigned)));
    PROBE_CUDA(cudaMemset(outcome, 0, sizeof(unsigned)));
    PROBE_CUDA(cudaDeviceSynchronize());
    void* copy_bytes = nullptr;  // [2][1 MiB] source and destination, and a word for the stream write
    if (behind == Behind::kCopies) PROBE_CUDA(cudaMalloc(&copy_bytes, (2 << 20) + 8));
    auto* copy_src = static_cast<unsigned char*>(copy_bytes);
    probe_spin_until<<<1, 1, 0, spin_on>>>(flag, want, outcome);
    PROBE_CUDA(cudaGetLastError());
    if (behind == Behind::kKernel) probe_noop<<<1, 1, 0, spin_on>>>();
    if (behind == Behind::kCopies) {
        PROBE_CUDA(cudaMemcpyAsync(copy_src + (1 << 20), copy_src, 1 << 20, cudaMemcpyDeviceToDevice, spin_on));
        weft::stream_write_u64(spin_on, reinterpret_cast<uint64_t*>(copy_src + (2 << 20)), 1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the spinner is running
    ProbeResult r;
    const auto t0 = std::chrono::steady_clock::now();
    if (host_call) host_call();
    r.host_call_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (behind == Behind::kCopies) {
        PROBE_CUDA(cudaMemcpyAsync(copy_src, copy_src + (1 << 20), 1 << 20, cudaMemcpyDeviceToDevice, set_on));
    }
    probe_set_flag<<<1, 1, 0, set_on>>>(flag, want);
    PROBE_CUDA(cudaGetLastError());
    PROBE_CUDA(cudaDeviceSynchronize());
    unsigned got = 0;
    PROBE_CUDA(cudaMemcpy(&got, outcome, sizeof(unsigned), cudaMemcpyDeviceToHost));
    r.saw_flag = got == 1;
    PROBE_CUDA(cudaFree(flag));
    PROBE_CUDA(cudaFree(outcome));
    if (copy_bytes != nullptr) PROBE_CUDA(cudaFree(copy_bytes));
    return r;
}

// ---- streams ------------------------------------------------------------------------------------------------

// weft's ops on a shared GPU need this: a rank's spinning kernel, and the work queued behind it on its stream,
// never hold back another stream's launch. Stream 0 runs the spinner and a kernel behind it, each other stream in
// turn the setter; then the same with streams whose first work ran while the others were idle (as each rank's
// stream after an upload it synchronised).
void probe_streams() {
    std::printf("streams: does a kernel on stream j start while stream 0's kernel spins waiting for it? "
                "(CUDA_DEVICE_MAX_CONNECTIONS=%d)\n",
                connections());
    for (bool used_while_idle : {false, true}) {
        std::vector<cudaStream_t> streams(40);
        for (auto& s : streams) {
            PROBE_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            if (used_while_idle) {
                probe_noop<<<1, 1, 0, s>>>();
                PROBE_CUDA(cudaStreamSynchronize(s));
            }
        }
        std::string held_back;
        for (size_t j = 1; j < streams.size(); ++j) {
            if (!probe(streams[0], streams[j], nullptr, static_cast<unsigned>(j), Behind::kKernel).saw_flag) {
                held_back += " " + std::to_string(j);
            }
        }
        for (auto& s : streams) PROBE_CUDA(cudaStreamDestroy(s));
        std::printf("  %-52s held back:%s\n",
                    used_while_idle ? "40 streams, each first used while the others idled" : "40 streams",
                    held_back.empty() ? " none" : held_back.c_str());
        if (connections() >= 8) expect(held_back.empty(), "streams held back behind a spinning kernel:" + held_back);
    }
    // Copies and a stream write queued behind the spinner, a copy ahead of each setter, 64 streams (8 ranks with a few
    // ops each): the copy-engine all-gather's schedule when ranks share a GPU, before it moved its bytes with the pull
    // kernel. Informational: weft no longer queues copies behind a spinning kernel there.
    std::vector<cudaStream_t> streams(64);
    for (auto& s : streams) PROBE_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::string held_back;
    for (size_t j = 1; j < streams.size(); ++j) {
        if (!probe(streams[0], streams[j], nullptr, static_cast<unsigned>(j), Behind::kCopies).saw_flag) {
            held_back += " " + std::to_string(j);
        }
    }
    for (auto& s : streams) PROBE_CUDA(cudaStreamDestroy(s));
    std::printf("  %-52s held back:%s\n", "64 streams, copies queued behind the spinner and ahead of the setter",
                held_back.empty() ? " none" : held_back.c_str());
}

// ---- host calls ------------------------------------------------------------------------------------------------

// Which host calls wait for a kernel spinning on another stream (CUDA's implicit synchronisation): a rank that
// makes such a call while a peer's kernel spins for it waits until the spin's timeout. Expected: the probe itself
// works (no call: seen, quick), and every call that returned before the spinner's timeout let it see its flag.
void probe_host_calls() {
    cudaStream_t a = nullptr, b = nullptr, c = nullptr;
    PROBE_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    PROBE_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    PROBE_CUDA(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
    void* spare = nullptr;
    void* spare2 = nullptr;
    PROBE_CUDA(cudaMalloc(&spare, 64 << 20));
    PROBE_CUDA(cudaMalloc(&spare2, 64 << 20));
    cudaGraph_t graph = nullptr;
    PROBE_CUDA(cudaStreamBeginCapture(c, cudaStreamCaptureModeThreadLocal));
    probe_noop<<<1, 1, 0, c>>>();
    PROBE_CUDA(cudaStreamEndCapture(c, &graph));
    std::vector<char> pageable(1 << 20), big_pageable(48 << 20);
    void* pinned = nullptr;
    PROBE_CUDA(cudaHostAlloc(&pinned, 1 << 20, cudaHostAllocDefault));

    std::vector<void*> to_free;
    std::string err;  // the first failing CUDA call of a row's host call
    const auto ok = [&err](cudaError_t e) {
        if (e != cudaSuccess && err.empty()) err = cudaGetErrorString(e);
    };
    struct Call {
        const char* name;
        std::function<void()> run;
    };
    // clang-format off
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
        {"cudaGraphInstantiate",
         [&] { cudaGraphExec_t e = nullptr; ok(cudaGraphInstantiate(&e, graph, 0)); ok(cudaGraphExecDestroy(e)); }},
        {"cudaStreamCreate + Destroy",
         [&] { cudaStream_t s = nullptr; ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
               ok(cudaStreamDestroy(s)); }},
        {"cudaEventCreate + Destroy",
         [&] { cudaEvent_t e = nullptr; ok(cudaEventCreate(&e)); ok(cudaEventDestroy(e)); }},
        {"cudaFuncSetAttribute",
         [&] { ok(cudaFuncSetAttribute(probe_noop, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 << 10)); }},
        {"a kernel on the legacy stream", [&] { probe_noop<<<1, 1>>>(); ok(cudaGetLastError()); }},
        {"cudaFree", [&] { for (void* p : to_free) ok(cudaFree(p)); to_free.clear(); }},
        // Work the setter's own stream holds ahead of it (a rank uploads, then launches).
        {"ahead on the setter's stream: H2D pageable 1 MiB",
         [&] { ok(cudaMemcpyAsync(spare, pageable.data(), pageable.size(), cudaMemcpyHostToDevice, b)); }},
        {"ahead on the setter's stream: H2D pageable 48 MiB",
         [&] { ok(cudaMemcpyAsync(spare, big_pageable.data(), big_pageable.size(), cudaMemcpyHostToDevice, b)); }},
        {"ahead on the setter's stream: H2D pinned 1 MiB",
         [&] { ok(cudaMemcpyAsync(spare, pinned, 1 << 20, cudaMemcpyHostToDevice, b)); }},
        {"ahead on the setter's stream: D2H pinned 1 MiB",
         [&] { ok(cudaMemcpyAsync(pinned, spare, 1 << 20, cudaMemcpyDeviceToHost, b)); }},
        {"ahead on the setter's stream: D2D 1 MiB",
         [&] { ok(cudaMemcpyAsync(spare2, spare, 1 << 20, cudaMemcpyDeviceToDevice, b)); }},
        {"ahead on the setter's stream: memset 1 MiB", [&] { ok(cudaMemsetAsync(spare, 0, 1 << 20, b)); }},
        {"ahead on the setter's stream: a kernel", [&] { probe_noop<<<1, 1, 0, b>>>(); ok(cudaGetLastError()); }},
    };
    // clang-format on
    std::printf("host-calls: a host call while a kernel of another stream spins  host ms  spinner saw its flag\n");
    for (const Call& call : calls) {
        err.clear();
        const ProbeResult r = probe(a, b, call.run, 7u);
        const bool waited = r.host_call_ms * 1e6 > 0.8 * static_cast<double>(kSpinTimeoutNs);
        std::printf("  %-60s %8.2f  %s%s\n", call.name, r.host_call_ms, r.saw_flag ? "yes" : "NO",
                    waited ? " (the call waited for the spinner)" : "");
        expect(err.empty(), std::string(call.name) + ": " + err);
        if (call.run == nullptr) {
            expect(r.saw_flag && r.host_call_ms < 1.0, "the probe itself: a setter on another stream did not reach "
                                                       "the spinner at once");
        }
        expect(waited || r.saw_flag,
               std::string(call.name) + " returned before the spin's timeout, yet the spinner never saw its flag");
    }
    for (void* p : to_free) cudaFree(p);
    PROBE_CUDA(cudaFreeHost(pinned));
    PROBE_CUDA(cudaGraphDestroy(graph));
    PROBE_CUDA(cudaFree(spare));
    PROBE_CUDA(cudaFree(spare2));
    for (cudaStream_t s : {a, b, c}) PROBE_CUDA(cudaStreamDestroy(s));
}

// ---- local memory --------------------------------------------------------------------------------------------

// Whether a kernel that needs more local memory than any kernel before it in the context can start while a kernel
// of another stream spins (the driver grows the context's local memory for it). Expected: 256 bytes per thread
// (within the default stack limit; weft's kernels use at most 128), as the context's first kernel with local
// memory, starts; once local memory is reserved (a kernel of that size ran while the device was idle, or the stack
// limit was raised that far), the same kernel starts beside a spinner.
void probe_local_memory() {
    cudaStream_t a = nullptr, b = nullptr;
    PROBE_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    PROBE_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    int* out = nullptr;
    PROBE_CUDA(cudaMalloc(&out, 32 * sizeof(int)));
    size_t stack = 0;
    PROBE_CUDA(cudaDeviceGetLimit(&stack, cudaLimitStackSize));
    struct Row {
        const char* name;
        std::function<void()> before;  // while the device is idle
        std::function<void()> ahead;   // on the setter's stream, ahead of it
        bool must_start;
    };
    const std::vector<Row> rows = {
        {"256 B local, the context's first kernel with local memory", nullptr,
         [&] { probe_local_memory<256><<<1, 32, 0, b>>>(1, out); }, true},
        {"4 KB local, more than the stack limit", nullptr, [&] { probe_local_memory<4096><<<1, 32, 0, b>>>(1, out); },
         false},
        {"8 KB local, more than before", nullptr, [&] { probe_local_memory<8192><<<1, 32, 0, b>>>(1, out); }, false},
        {"16 KB local, after one ran while idle", [&] { probe_local_memory<16384><<<1, 32, 0, b>>>(1, out); },
         [&] { probe_local_memory<16384><<<1, 32, 0, b>>>(1, out); }, true},
        {"32 KB local, after the stack limit was raised to 48 KB",
         [&] { PROBE_CUDA(cudaDeviceSetLimit(cudaLimitStackSize, 48 << 10)); },
         [&] { probe_local_memory<32768><<<1, 32, 0, b>>>(1, out); }, true},
    };
    std::printf("local-memory: a kernel queued ahead of the setter (default stack limit %zu bytes per thread)\n",
                stack);
    for (const Row& row : rows) {
        if (row.before) {
            row.before();
            PROBE_CUDA(cudaDeviceSynchronize());
        }
        const ProbeResult r = probe(a, b, row.ahead, 9u);
        PROBE_CUDA(cudaGetLastError());
        std::printf("  %-60s spinner saw its flag: %s\n", row.name, r.saw_flag ? "yes" : "NO");
        if (row.must_start) expect(r.saw_flag, std::string(row.name) + ": did not start beside a spinning kernel");
    }
    PROBE_CUDA(cudaDeviceSetLimit(cudaLimitStackSize, stack));
    PROBE_CUDA(cudaFree(out));
    PROBE_CUDA(cudaStreamDestroy(a));
    PROBE_CUDA(cudaStreamDestroy(b));
}

// ---- ranks of a World ----------------------------------------------------------------------------------------

// The pattern of weft's ops on a shared GPU inside a World (run_local, one stream per rank, every SM at 200 KB of
// dynamic shared memory per block): kCalls calls per rank launched back to back, each waiting for the same call of
// every other rank, the arrival words in plain device memory or in the symmetric heap (every rank adds to rank 0's
// words through its own mapping). The World's constructor launches the context's first kernel: without that, the
// first trial timed out now and then (docs/runtime.md, "A context's first kernel launch"). Expected: no trial
// times out.
void probe_world() {
    constexpr int kCalls = 4, kTrials = 4, kSmem = 200 << 10;
    int sms = 0;
    PROBE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    PROBE_CUDA(cudaFuncSetAttribute(probe_rank_call, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    std::printf("world: ranks of a World waiting for each other's calls (%d calls per trial, %d trials)\n", kCalls,
                kTrials);
    for (int ranks : {2, 3}) {
        for (bool in_heap : {false, true}) {
            unsigned* plain = nullptr;
            PROBE_CUDA(cudaMalloc(&plain, (kCalls + 1) * sizeof(unsigned)));
            std::string bad;
            std::atomic<int> launch_errors{0};
            weft::run_local(ranks, [&](weft::World& w) {
                cudaStream_t st = nullptr;
                PROBE_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
                uint64_t* mine = w.heap().alloc_signals(kCalls + 1);
                auto* words = in_heap ? reinterpret_cast<unsigned*>(w.heap().symm_at(mine, 0)) : plain;
                for (int trial = 0; trial < kTrials; ++trial) {
                    if (w.rank() == 0) {
                        PROBE_CUDA(cudaMemsetAsync(words, 0, (kCalls + 1) * sizeof(unsigned), st));
                        PROBE_CUDA(cudaStreamSynchronize(st));
                    }
                    w.barrier();
                    for (int c = 0; c < kCalls; ++c) {
                        probe_rank_call<<<sms / ranks, 128, kSmem, st>>>(words + c, static_cast<unsigned>(ranks),
                                                                         words + kCalls);
                    }
                    launch_errors += cudaGetLastError() != cudaSuccess;
                    PROBE_CUDA(cudaStreamSynchronize(st));
                    w.barrier();
                    if (w.rank() == 0) {
                        unsigned failed = 0;
                        PROBE_CUDA(cudaMemcpy(&failed, words + kCalls, sizeof(unsigned), cudaMemcpyDeviceToHost));
                        if (failed != 0) bad += " " + std::to_string(trial);
                    }
                    w.barrier();
                }
                w.heap().free(mine);
                PROBE_CUDA(cudaStreamDestroy(st));
            });
            PROBE_CUDA(cudaFree(plain));
            std::printf("  %d ranks, words in %-17s: trials timed out:%s\n", ranks,
                        in_heap ? "the heap" : "cudaMalloc memory", bad.empty() ? " none" : bad.c_str());
            expect(launch_errors == 0, "a launch failed");
            if (connections() >= 8) expect(bad.empty(), "trials timed out:" + bad);
        }
    }
}

// Runs `self --probe name` for each probe, one process each; the worst exit status wins.
int run_each_in_a_fresh_process(const char* self, const std::vector<std::string>& probes) {
    int worst = 0;
    for (const std::string& name : probes) {
        std::fflush(stdout);
        const pid_t pid = fork();
        if (pid == 0) {
            execl("/proc/self/exe", self, "--probe", name.c_str(), static_cast<char*>(nullptr));
            std::perror("exec");
            _exit(127);
        }
        int status = 0;
        if (pid < 0 || waitpid(pid, &status, 0) != pid) {
            std::perror("weft_probe_shared_gpu: fork/wait");
            return 1;
        }
        const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
        if (rc != 0) std::printf("  (probe %s: exit status %d)\n", name.c_str(), rc);
        worst = std::max(worst, rc);
    }
    return worst;
}

}  // namespace

int main(int argc, char** argv) {
    return weft::bench::run_main("weft_probe_shared_gpu", [&] {
        const std::vector<std::string> probes = {"streams", "host-calls", "local-memory", "world"};
        std::string which = "all";
        weft::bench::Cli cli("weft_probe_shared_gpu", "what ranks sharing a GPU rely on, probed on this machine");
        cli.option("--probe", "NAME", "streams, host-calls, local-memory, world or all (default all)",
                   [&](const std::string& v) {
                       std::vector<std::string> allowed = probes;
                       allowed.push_back("all");
                       which = weft::bench::parse_choice(v, "--probe", allowed);
                   });
        cli.parse(argc, argv);
        if (which == "all") return run_each_in_a_fresh_process(argv[0], probes);
        weft::prepare_cuda_environment();  // before the first CUDA call: eager loading, hardware queues
        if (which == "streams") probe_streams();
        if (which == "host-calls") probe_host_calls();
        if (which == "local-memory") probe_local_memory();
        if (which == "world") probe_world();
        return g_unexpected == 0 ? 0 : 1;
    });
}
