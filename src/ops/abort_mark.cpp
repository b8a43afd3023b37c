// SPDX-License-Identifier: MIT
#include "abort_mark.hpp"

#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops::detail {

void AbortMark::note(const World& world) { cleared_at_make = world.cleared_aborts(); }

void AbortMark::check(const World& world, const char* what, const char* remedy) const {
    WEFT_CHECK(world.cleared_aborts() == cleared_at_make,
               what << ": this World was aborted after " << what << " was made (" << world.last_cleared_abort()
                    << "), and clear_diagnostics does not repair its device state: a wait that gave up may have left "
                       "its flags and epochs out of step across ranks; "
                    << remedy);
}

void log_failed_release(const World& world, const char* what, const std::exception& e) noexcept {
    if (world.aborted()) {
        WEFT_LOG_INFO("the World was aborted: " << what
                                                << "'s symmetric memory stays in its heap until it is destroyed");
    } else {
        WEFT_LOG_ERROR("releasing " << what << "'s symmetric memory failed: " << e.what());
    }
}

}  // namespace weft::ops::detail
