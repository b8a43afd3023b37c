// SPDX-License-Identifier: MIT
// NVTX ranges in the "weft" domain (NVTX3 is header-only: nothing to link).
#include "weft/runtime/nvtx.hpp"

#include <nvtx3/nvToolsExt.h>

namespace weft {

namespace {
nvtxDomainHandle_t domain() {
    static const nvtxDomainHandle_t d = nvtxDomainCreateA("weft");
    return d;
}

nvtxEventAttributes_t attributes(const char* name) {
    nvtxEventAttributes_t a{};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = name != nullptr ? name : "";
    return a;
}
}  // namespace

NvtxRange::NvtxRange(const char* name) noexcept {
    const nvtxEventAttributes_t a = attributes(name);
    nvtxDomainRangePushEx(domain(), &a);
}

NvtxRange::~NvtxRange() { nvtxDomainRangePop(domain()); }

void nvtx_mark(const char* name) noexcept {
    const nvtxEventAttributes_t a = attributes(name);
    nvtxDomainMarkEx(domain(), &a);
}

}  // namespace weft
