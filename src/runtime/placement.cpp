// SPDX-License-Identifier: MIT
// Which ranks share a host or a process, from the records every rank publishes (see runtime_placement.hpp).
#include <unistd.h>

#include <map>
#include <sstream>

#include "runtime_internal.hpp"
#include "weft/detail/runtime_placement.hpp"
#include "weft/runtime/error.hpp"

namespace weft::detail {

namespace {

Bytes encode(const ProcessRecord& r) {
    const std::string text = r.host + "\n" + r.pid_namespace + "\n" + std::to_string(r.pid);
    return Bytes(text.begin(), text.end());
}

ProcessRecord decode(const Bytes& blob, int from_rank) {
    const std::string text(blob.begin(), blob.end());
    const size_t first = text.find('\n');
    const size_t second = first == std::string::npos ? first : text.find('\n', first + 1);
    ProcessRecord r;
    bool ok = second != std::string::npos && first > 0;
    if (ok) {
        r.host = text.substr(0, first);
        r.pid_namespace = text.substr(first + 1, second - first - 1);
        const std::string pid = text.substr(second + 1);
        ok = !pid.empty() && pid.size() <= 18 && pid.find_first_not_of("0123456789") == std::string::npos;
        if (ok) r.pid = std::stoll(pid);
    }
    WEFT_CHECK(ok && r.pid > 0, "rank " << from_rank << " published a malformed process record '"
                                        << text.substr(0, 80) << "' (ranks built from different weft versions?)");
    return r;
}

std::string process_key(const ProcessRecord& r) { return r.host + "|" + r.pid_namespace + "|" + std::to_string(r.pid); }

}  // namespace

std::string host_name() {
    char name[256] = {};
    if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
    return name;
}

ProcessRecord this_process_record() {
    ProcessRecord r;
    r.host = host_name();
    char link[128] = {};
    const ssize_t n = ::readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
    if (n > 0) r.pid_namespace.assign(link, static_cast<size_t>(n));
    r.pid = static_cast<int64_t>(::getpid());
    return r;
}

Placement placement_from_records(const std::vector<ProcessRecord>& records, int rank) {
    const int num_ranks = static_cast<int>(records.size());
    WEFT_CHECK(rank >= 0 && rank < num_ranks, "placement: rank " << rank << " is outside [0, " << num_ranks << ")");
    Placement p;
    p.local_rank = 0;
    p.local_num_ranks = 0;
    std::map<std::string, std::vector<int>> by_process;
    for (int r = 0; r < num_ranks; ++r) {
        const ProcessRecord& rec = records[static_cast<size_t>(r)];
        if (rec.host == records[static_cast<size_t>(rank)].host) {
            if (r < rank) ++p.local_rank;
            ++p.local_num_ranks;
        }
        by_process[process_key(rec)].push_back(r);
    }
    p.same_process = by_process.size() == 1;
    if (!p.same_process && by_process.size() != records.size()) {
        // Some ranks are threads of one process, others are not: the heap is either shared inside a process
        // or passed between processes, not both.
        std::ostringstream os;
        os << "a World's ranks are all threads of one process or all processes of their own, but ";
        bool first = true;
        for (const auto& [key, ranks] : by_process) {
            if (ranks.size() < 2) continue;
            const ProcessRecord& rec = records[static_cast<size_t>(ranks[0])];
            os << (first ? "" : "; ") << format_rank_list(ranks) << " are threads of pid " << rec.pid << " on "
               << rec.host;
            first = false;
        }
        os << ", among " << num_ranks << " ranks in " << by_process.size() << " processes";
        WEFT_FAIL(os.str());
    }
    return p;
}

Placement exchange_placement(Store& store, const std::string& name, int rank, int num_ranks,
                             std::chrono::milliseconds timeout) {
    const std::vector<Bytes> blobs = store.all_gather(name, rank, num_ranks, encode(this_process_record()), timeout);
    std::vector<ProcessRecord> records;
    records.reserve(blobs.size());
    for (int r = 0; r < num_ranks; ++r) records.push_back(decode(blobs[static_cast<size_t>(r)], r));
    return placement_from_records(records, rank);
}

}  // namespace weft::detail
