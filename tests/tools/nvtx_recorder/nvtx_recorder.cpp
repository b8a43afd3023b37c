// SPDX-License-Identifier: MIT
// An NVTX injection library for tests: records every range push, pop and mark to the file named by WEFT_NVTX_RECORD.
//
// Load it with NVTX_INJECTION64_PATH=<path to this library>: NVTX loads it at the process's first NVTX call and calls
// InitializeInjectionNvtx2, which points NVTX's callback slots (core and core2 modules) at the functions below. One
// line per event, written as it happens (line-buffered, so a crash keeps what came before):
//
//   <thread> push <domain> <message>
//   <thread> pop <domain>
//   <thread> mark <domain> <message>
//
// <thread> numbers the calling threads 0, 1, ... in the order of their first event; <domain> is the domain's name
// with spaces written as '_' ("(default)" for the calls without one). Only ASCII messages are read; others are
// written as "(not ascii)".
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

// The domain handle NVTX hands back to the program is a pointer to this (the struct is the tool's to define).
struct nvtxDomainRegistration_st {
    std::string name;
};

namespace {

std::mutex g_mutex;
std::FILE* g_file = nullptr;
std::atomic<int> g_next_thread{0};

int thread_index() {
    thread_local const int index = g_next_thread.fetch_add(1);
    return index;
}

const char* domain_name(nvtxDomainHandle_t domain) { return domain != nullptr ? domain->name.c_str() : "(default)"; }

const char* message_of(const nvtxEventAttributes_t* a) {
    if (a == nullptr || a->messageType != NVTX_MESSAGE_TYPE_ASCII || a->message.ascii == nullptr) return "(not ascii)";
    return a->message.ascii;
}

void record(const char* event, const char* domain, const char* message) {
    const int thread = thread_index();
    const std::lock_guard<std::mutex> lock(g_mutex);
    if (message != nullptr) {
        std::fprintf(g_file, "%d %s %s %s\n", thread, event, domain, message);
    } else {
        std::fprintf(g_file, "%d %s %s\n", thread, event, domain);
    }
}

// NVTX returns a push's and a pop's nesting level (of the calling thread); the recorder keeps one per thread.
thread_local int t_depth = 0;

int push(nvtxDomainHandle_t domain, const char* message) {
    record("push", domain_name(domain), message);
    return t_depth++;
}

int pop(nvtxDomainHandle_t domain) {
    record("pop", domain_name(domain), nullptr);
    return t_depth > 0 ? --t_depth : -1;
}

// core2: the domain calls (weft's).
nvtxDomainHandle_t domain_create_a(const char* name) {
    std::string n = name != nullptr && *name != '\0' ? name : "(unnamed)";
    std::replace(n.begin(), n.end(), ' ', '_');  // one field of the line
    return new nvtxDomainRegistration_st{n};     // NOTE: kept for the process's life
}
void domain_destroy(nvtxDomainHandle_t) {}  // handles stay valid: a late event may still name the domain
int domain_range_push_ex(nvtxDomainHandle_t domain, const nvtxEventAttributes_t* a) {
    return push(domain, message_of(a));
}
int domain_range_pop(nvtxDomainHandle_t domain) { return pop(domain); }
void domain_mark_ex(nvtxDomainHandle_t domain, const nvtxEventAttributes_t* a) {
    record("mark", domain_name(domain), message_of(a));
}

// core: the calls without a domain.
int range_push_a(const char* message) { return push(nullptr, message != nullptr ? message : ""); }
int range_push_ex(const nvtxEventAttributes_t* a) { return push(nullptr, message_of(a)); }
int range_pop() { return pop(nullptr); }
void mark_a(const char* message) { record("mark", "(default)", message != nullptr ? message : ""); }
void mark_ex(const nvtxEventAttributes_t* a) { record("mark", "(default)", message_of(a)); }

template <typename Fn>
bool set_slot(NvtxFunctionTable table, unsigned int size, unsigned int id, Fn fn) {
    if (table == nullptr || id >= size || table[id] == nullptr) return false;
    *table[id] = reinterpret_cast<NvtxFunctionPointer>(fn);
    return true;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_table) {
    const char* path = std::getenv("WEFT_NVTX_RECORD");
    if (path == nullptr || *path == '\0') {
        std::fprintf(stderr, "weft nvtx recorder: WEFT_NVTX_RECORD (the file to write the events to) is not set\n");
        return 0;
    }
    const auto* callbacks = static_cast<const NvtxExportTableCallbacks*>(get_table(NVTX_ETID_CALLBACKS));
    if (callbacks == nullptr || callbacks->GetModuleFunctionTable == nullptr) {
        std::fprintf(stderr, "weft nvtx recorder: NVTX gave no callback table\n");
        return 0;
    }
    NvtxFunctionTable core = nullptr, core2 = nullptr;
    unsigned int core_size = 0, core2_size = 0;
    if (!callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &core, &core_size) ||
        !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &core2, &core2_size)) {
        std::fprintf(stderr, "weft nvtx recorder: NVTX has no core or core2 module table\n");
        return 0;
    }
    const bool ok = set_slot(core2, core2_size, NVTX_CBID_CORE2_DomainCreateA, &domain_create_a) &&
                    set_slot(core2, core2_size, NVTX_CBID_CORE2_DomainDestroy, &domain_destroy) &&
                    set_slot(core2, core2_size, NVTX_CBID_CORE2_DomainRangePushEx, &domain_range_push_ex) &&
                    set_slot(core2, core2_size, NVTX_CBID_CORE2_DomainRangePop, &domain_range_pop) &&
                    set_slot(core2, core2_size, NVTX_CBID_CORE2_DomainMarkEx, &domain_mark_ex) &&
                    set_slot(core, core_size, NVTX_CBID_CORE_RangePushA, &range_push_a) &&
                    set_slot(core, core_size, NVTX_CBID_CORE_RangePushEx, &range_push_ex) &&
                    set_slot(core, core_size, NVTX_CBID_CORE_RangePop, &range_pop) &&
                    set_slot(core, core_size, NVTX_CBID_CORE_MarkA, &mark_a) &&
                    set_slot(core, core_size, NVTX_CBID_CORE_MarkEx, &mark_ex);
    if (!ok) {
        std::fprintf(stderr, "weft nvtx recorder: NVTX's callback table lacks a slot the recorder fills\n");
        return 0;
    }
    // NVTX calls none of the slots before this returns (and resets them all if it returns 0).
    g_file = std::fopen(path, "w");
    if (g_file == nullptr) {
        std::fprintf(stderr, "weft nvtx recorder: cannot write WEFT_NVTX_RECORD=%s\n", path);
        return 0;
    }
    std::setvbuf(g_file, nullptr, _IOLBF, 0);
    if (const auto* version = static_cast<const NvtxExportTableVersionInfo*>(get_table(NVTX_ETID_VERSIONINFO));
        version != nullptr && version->SetInjectionNvtxVersion != nullptr) {
        version->SetInjectionNvtxVersion(NVTX_VERSION);
    }
    return 1;
}
