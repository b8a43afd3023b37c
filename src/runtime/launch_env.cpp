// SPDX-License-Identifier: MIT
// Reads a process's rank, world size and rendezvous address from the environment of its launcher.
#include "weft/runtime/launch_env.hpp"

#include <cctype>
#include <cstdint>
#include <limits>
#include <vector>

#include "weft/detail/launch_store.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"

extern char** environ;  // NOLINT: POSIX

namespace weft {

namespace {

using VarMap = std::map<std::string, std::string>;

const std::string* find(const VarMap& vars, const char* name) {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : &it->second;
}

/// The first of `names` that is set, or nullptr; `*which` receives its name.
const std::string* find_first(const VarMap& vars, std::initializer_list<const char*> names, const char** which) {
    for (const char* name : names) {
        if (const std::string* v = find(vars, name)) {
            *which = name;
            return v;
        }
    }
    return nullptr;
}

int to_int(const std::string& text, const char* name) {
    int64_t v = env::parse_int(text, name);
    WEFT_CHECK(v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(),
               name << " is out of range: '" << text << "'");
    return static_cast<int>(v);
}

int required_int(const VarMap& vars, const char* name, const char* because) {
    const std::string* v = find(vars, name);
    WEFT_CHECK(v != nullptr, name << " must be set " << because << ", but it is not");
    return to_int(*v, name);
}

/// Checks rank / size / local rank / local size against each other; the names are the variables read.
void check_ranks(const LaunchEnv& e, const char* rank_name, const char* size_name, const char* local_rank_name,
                 const char* local_size_name) {
    WEFT_CHECK(e.num_ranks >= 1, size_name << " must be at least 1, got " << e.num_ranks);
    WEFT_CHECK(e.rank >= 0 && e.rank < e.num_ranks,
               rank_name << " must be in [0, " << size_name << "=" << e.num_ranks << "), got " << e.rank);
    WEFT_CHECK(e.local_num_ranks >= 1 && e.local_num_ranks <= e.num_ranks,
               local_size_name << " must be in [1, " << size_name << "=" << e.num_ranks << "], got "
                               << e.local_num_ranks);
    WEFT_CHECK(e.local_rank >= 0 && e.local_rank < e.local_num_ranks,
               local_rank_name << " must be in [0, " << local_size_name << "=" << e.local_num_ranks << "), got "
                               << e.local_rank);
}

int parse_port(const std::string& text, const char* name) {
    int port = to_int(text, name);
    WEFT_CHECK(port >= 1 && port <= 65535, name << " must be a TCP port in [1, 65535], got " << port);
    return port;
}

/// MASTER_ADDR, or 127.0.0.1 when every rank is on this host; `fallback` is used (if non-empty) otherwise.
std::string master_addr(const VarMap& vars, const LaunchEnv& e, const std::string& fallback) {
    if (const std::string* v = find(vars, "MASTER_ADDR")) {
        WEFT_CHECK(!v->empty(), "MASTER_ADDR must name the rendezvous host, but it is empty");
        return *v;
    }
    if (e.local_num_ranks == e.num_ranks) return "127.0.0.1";
    WEFT_CHECK(!fallback.empty(), "MASTER_ADDR must be set when ranks span several hosts ("
                                      << e.local_num_ranks << " of " << e.num_ranks
                                      << " ranks are on this host), but it is not");
    return fallback;
}

/// MASTER_PORT as the launcher set it, 0 when unset.
int master_port(const VarMap& vars) {
    const std::string* v = find(vars, "MASTER_PORT");
    return v != nullptr ? parse_port(*v, "MASTER_PORT") : 0;
}

/// `job_id` when non-empty, else MASTER_ADDR:MASTER_PORT (a hand-made environment names its job by the port it
/// gives); a single rank needs none.
std::string job_id_or_master(const LaunchEnv& e, std::string job_id, const char* job_id_vars) {
    if (!job_id.empty()) return job_id;
    if (e.master_port != 0) return "MASTER " + e.master_addr + ":" + std::to_string(e.master_port);
    WEFT_CHECK(e.num_ranks == 1, "MASTER_PORT must be set for a job of "
                                     << e.num_ranks << " ranks (without a job id in " << job_id_vars
                                     << ", it names the job), but it is not");
    return {};
}

LaunchEnv parse_torchrun(const VarMap& vars) {
    LaunchEnv e;
    const std::string* run_id = find(vars, "TORCHELASTIC_RUN_ID");
    const std::string* weftrun_id = find(vars, "WEFT_RUN_ID");
    e.launcher = run_id == nullptr && (weftrun_id != nullptr || find(vars, "WEFT_JOB_TOKEN") != nullptr) ? "weftrun"
                                                                                                          : "torchrun";
    e.rank = required_int(vars, "RANK", "when WORLD_SIZE is");
    e.num_ranks = required_int(vars, "WORLD_SIZE", "when RANK is");
    // A hand-made environment may set only RANK and WORLD_SIZE: that means one host.
    const std::string* local_rank = find(vars, "LOCAL_RANK");
    const std::string* local_size = find(vars, "LOCAL_WORLD_SIZE");
    e.local_rank = local_rank ? to_int(*local_rank, "LOCAL_RANK") : e.rank;
    e.local_num_ranks = local_size ? to_int(*local_size, "LOCAL_WORLD_SIZE") : e.num_ranks;
    WEFT_CHECK(local_rank != nullptr || e.local_num_ranks >= e.num_ranks,
               "LOCAL_RANK must be set when LOCAL_WORLD_SIZE (" << e.local_num_ranks << ") is less than WORLD_SIZE ("
                                                                << e.num_ranks << "), but it is not");
    check_ranks(e, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    e.master_addr = master_addr(vars, e, "");
    e.master_port = master_port(vars);
    WEFT_CHECK(e.master_port != 0 || e.num_ranks == 1,
               "MASTER_PORT must be set for a job of " << e.num_ranks << " ranks (it names the job), but it is not");
    if (local_size == nullptr && e.num_ranks > 1 && !is_loopback_name(e.master_addr)) {
        WEFT_LOG_WARN("LOCAL_WORLD_SIZE is not set: weft takes all "
                      << e.num_ranks << " ranks to run on this host (MASTER_ADDR " << e.master_addr
                      << "); a job across hosts must set LOCAL_WORLD_SIZE and LOCAL_RANK, or its ranks on other "
                         "hosts wait for a store on this one until the timeout");
    }
    std::string job_id;
    if (run_id != nullptr) {
        // The run id alone may be the default "none"; the agent's store address is held for the job's life. On one
        // host the restart count tells a restarted World from its predecessor; across hosts it does not enter the
        // name: torchrun's agents do not agree on it (an agent restarts on a membership change without counting it),
        // and the agent stops every old worker, and so its store, before it restarts.
        const std::string* restart = find(vars, "TORCHELASTIC_RESTART_COUNT");
        job_id = "torchrun " + *run_id + " " + e.master_addr + ":" + std::to_string(e.master_port);
        if (e.local_num_ranks == e.num_ranks) {
            job_id += " restart " + (restart != nullptr ? *restart : std::string("0"));
        }
    } else if (weftrun_id != nullptr && !weftrun_id->empty()) {
        job_id = "weftrun " + *weftrun_id;
    }
    e.job_id = job_id_or_master(e, job_id, "TORCHELASTIC_RUN_ID or WEFT_RUN_ID");
    return e;
}

/// Open MPI's job id: the same string on every rank of one mpirun.
std::string ompi_job_id(const VarMap& vars) {
    const char* which = nullptr;
    if (const std::string* v = find_first(vars, {"OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid",
                                                 "PMIX_NAMESPACE"}, &which)) {
        return std::string(which) + "=" + *v;
    }
    if (const std::string* v = find(vars, "SLURM_JOB_ID")) {
        const std::string* step = find(vars, "SLURM_STEP_ID");
        return "SLURM_JOB_ID=" + *v + "." + (step ? *step : std::string());
    }
    return {};
}

LaunchEnv parse_ompi(const VarMap& vars) {
    LaunchEnv e;
    e.launcher = "mpirun";
    e.rank = required_int(vars, "OMPI_COMM_WORLD_RANK", "under Open MPI");
    e.num_ranks = required_int(vars, "OMPI_COMM_WORLD_SIZE", "under Open MPI");
    e.local_rank = required_int(vars, "OMPI_COMM_WORLD_LOCAL_RANK", "under Open MPI");
    e.local_num_ranks = required_int(vars, "OMPI_COMM_WORLD_LOCAL_SIZE", "under Open MPI");
    check_ranks(e, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE");
    e.master_addr = master_addr(vars, e, "");
    e.master_port = master_port(vars);
    e.job_id = job_id_or_master(e, ompi_job_id(vars),
                                "OMPI_MCA_ess_base_jobid, OMPI_MCA_orte_ess_jobid, PMIX_NAMESPACE or SLURM_JOB_ID");
    return e;
}

/// Slurm's per-node task counts, "2(x3),1" -> {2, 2, 2, 1}.
std::vector<int> expand_tasks_per_node(const std::string& text, const char* name) {
    std::vector<int> counts;
    size_t pos = 0;
    auto fail = [&]() { WEFT_FAIL(name << " must look like '4' or '2(x3),1', got '" << text << "'"); };
    auto read_number = [&]() {
        size_t start = pos;
        while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) ++pos;
        if (pos == start || pos - start > 6) fail();
        return std::stoi(text.substr(start, pos - start));
    };
    while (true) {
        int count = read_number();
        int repeat = 1;
        if (pos < text.size() && text[pos] == '(') {
            if (text.compare(pos, 2, "(x") != 0) fail();
            pos += 2;
            repeat = read_number();
            if (pos >= text.size() || text[pos] != ')') fail();
            ++pos;
        }
        if (repeat < 1 || counts.size() + static_cast<size_t>(repeat) > 1000000) fail();
        counts.insert(counts.end(), static_cast<size_t>(repeat), count);
        if (pos == text.size()) break;
        if (text[pos] != ',') fail();
        ++pos;
    }
    return counts;
}

LaunchEnv parse_slurm(const VarMap& vars) {
    LaunchEnv e;
    e.launcher = "srun";
    e.rank = required_int(vars, "SLURM_PROCID", "under srun");
    const char* size_name = nullptr;
    const std::string* size = find_first(vars, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"}, &size_name);
    WEFT_CHECK(size != nullptr, "SLURM_NTASKS (or SLURM_STEP_NUM_TASKS) must be set when SLURM_PROCID is, but it is not");
    e.num_ranks = to_int(*size, size_name);
    e.local_rank = required_int(vars, "SLURM_LOCALID", "when SLURM_PROCID is");

    const char* per_node_name = nullptr;
    const char* local_size_name = "SLURM_TASKS_PER_NODE";
    if (const std::string* per_node =
            find_first(vars, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}, &per_node_name)) {
        std::vector<int> counts = expand_tasks_per_node(*per_node, per_node_name);
        int node = 0;
        if (counts.size() > 1) node = required_int(vars, "SLURM_NODEID", "when tasks span several nodes");
        WEFT_CHECK(node >= 0 && static_cast<size_t>(node) < counts.size(),
                   "SLURM_NODEID=" << node << " has no entry in " << per_node_name << "='" << *per_node << "'");
        e.local_num_ranks = counts[static_cast<size_t>(node)];
        local_size_name = per_node_name;
    } else if (const std::string* per_node_fixed = find(vars, "SLURM_NTASKS_PER_NODE")) {
        e.local_num_ranks = to_int(*per_node_fixed, "SLURM_NTASKS_PER_NODE");
        local_size_name = "SLURM_NTASKS_PER_NODE";
    } else {
        const char* nodes_name = nullptr;
        const std::string* nodes = find_first(vars, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"},
                                              &nodes_name);
        WEFT_CHECK(nodes != nullptr && to_int(*nodes, nodes_name) == 1,
                   "SLURM_TASKS_PER_NODE (or SLURM_STEP_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE) must be set "
                   "unless the step runs on one node, but it is not");
        e.local_num_ranks = e.num_ranks;
        local_size_name = nodes_name;
    }
    check_ranks(e, "SLURM_PROCID", size_name, "SLURM_LOCALID", local_size_name);

    const char* list_name = nullptr;
    const std::string* node_list =
        find_first(vars, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}, &list_name);
    std::string fallback_addr;
    if (node_list != nullptr && e.local_num_ranks != e.num_ranks && find(vars, "MASTER_ADDR") == nullptr) {
        WEFT_CHECK(!node_list->empty(), list_name << " must list the step's hosts, but it is empty");
        fallback_addr = first_slurm_host(*node_list);
    }
    e.master_addr = master_addr(vars, e, fallback_addr);

    std::string job_id;
    if (const std::string* job = find(vars, "SLURM_JOB_ID")) {
        const char* step_name = nullptr;
        const std::string* step = find_first(vars, {"SLURM_STEP_ID", "SLURM_STEPID"}, &step_name);
        job_id = "SLURM_JOB_ID=" + *job + "." + (step ? *step : std::string());
    }
    e.master_port = master_port(vars);
    e.job_id = job_id_or_master(e, job_id, "SLURM_JOB_ID");
    return e;
}

}  // namespace

int derived_master_port(const std::string& key) {
    return 20000 + static_cast<int>(detail::stable_hash64(key) % 12768u);
}

bool is_loopback_name(const std::string& host) {
    return host.empty() || host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::string first_slurm_host(const std::string& host_list) {
    WEFT_CHECK(!host_list.empty(), "a Slurm host list must not be empty");
    std::string host;
    size_t pos = 0;
    while (pos < host_list.size() && host_list[pos] != ',') {
        char c = host_list[pos];
        if (c == '[') {
            size_t close = host_list.find(']', pos);
            WEFT_CHECK(close != std::string::npos, "unbalanced '[' in Slurm host list '" << host_list << "'");
            // The first element of the range set: "03-05,9" -> "03".
            size_t end = pos + 1;
            while (end < close && host_list[end] != '-' && host_list[end] != ',') ++end;
            WEFT_CHECK(end > pos + 1, "empty range in Slurm host list '" << host_list << "'");
            host += host_list.substr(pos + 1, end - pos - 1);
            pos = close + 1;
        } else {
            host += c;
            ++pos;
        }
    }
    WEFT_CHECK(!host.empty(), "Slurm host list '" << host_list << "' starts with an empty host name");
    return host;
}

// Launchers weft does not read (MPICH and Intel MPI's Hydra, MVAPICH2): every process would make a World of its own,
// on device 0, and the collectives would return each rank's own input. Refused, saying what works, when their size
// says several processes and `launched_size` / `launched_rank` (those of the launcher weft read, 0 / -1: none) are not
// theirs: Hydra inside a Slurm allocation starts its proxies with srun, so its ranks carry the proxy's SLURM_* (rank 0
// of one task per node), and inside a batch script the batch step's (rank 0 of its tasks), while srun --mpi=pmi2 sets
// PMI_SIZE and PMI_RANK to its own.
void refuse_foreign_launcher(const VarMap& vars, int launched_size, int launched_rank) {
    const char* size_name = nullptr;
    const std::string* size = find_first(vars, {"PMI_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"}, &size_name);
    if (size == nullptr) return;
    const int n = to_int(*size, size_name);
    // Same size and, where the launcher says it, the same rank: srun's own PMI (inherited batch-step variables
    // with mpiexec's ranks would have the size right and every rank 0).
    const std::string* pmi_rank = find(vars, "PMI_RANK");
    const bool same_rank = pmi_rank == nullptr || to_int(*pmi_rank, "PMI_RANK") == launched_rank;
    if (n <= 1 || (n == launched_size && same_rank)) return;
    WEFT_FAIL(size_name << "=" << *size << " says this process is one of several that a launcher weft does not read "
                        << "started (MPICH, Intel MPI, MVAPICH2)"
                        << (launched_size > 0
                                ? " (the Slurm variables it inherited say rank " + std::to_string(launched_rank) +
                                      " of " + std::to_string(launched_size) + " task(s): not this launch's)"
                                : std::string())
                        << "; start them with weftrun, torchrun, Open MPI's mpirun or srun, or set RANK, WORLD_SIZE, "
                           "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each");
}

namespace {

// A batch script's own process (sbatch, or salloc with an interactive step) carries SLURM_PROCID=0 and the job's
// SLURM_NTASKS, but none of the variables srun sets for a step it starts (SLURM_STEP_ID, SLURM_STEP_NUM_TASKS), and
// ENVIRONMENT=BATCH. Slurm's batch step id (4294967294) is taken as no step too.
bool is_slurm_batch_step(const VarMap& vars) {
    const std::string* environment = find(vars, "ENVIRONMENT");
    if (environment == nullptr || *environment != "BATCH") return false;
    const char* step_name = nullptr;
    const std::string* step = find_first(vars, {"SLURM_STEP_ID", "SLURM_STEPID"}, &step_name);
    if (step != nullptr && *step != "4294967294") return false;
    return find(vars, "SLURM_STEP_NUM_TASKS") == nullptr;
}

// A program run straight from a batch script of several tasks is one process, not the job's tasks: reading it as
// rank 0 of SLURM_NTASKS would wait for ranks that never start. Refused, saying what works; a batch script of one
// task is a job of one rank.
void refuse_batch_step_of_several_tasks(const VarMap& vars) {
    const char* size_name = nullptr;
    const std::string* size = find_first(vars, {"SLURM_NTASKS", "SLURM_NPROCS"}, &size_name);
    const int tasks = size == nullptr ? 1 : to_int(*size, size_name);
    refuse_foreign_launcher(vars, tasks, 0);
    WEFT_CHECK(tasks <= 1,
               "this process is a Slurm batch script's own (ENVIRONMENT=BATCH, SLURM_PROCID set, no "
               "SLURM_STEP_ID): "
                   << size_name << "=" << *size
                   << " counts the job's tasks, which srun starts; run the program with srun inside the "
                      "script (srun ./prog), or start the ranks with weftrun or torchrun");
}

}  // namespace

std::optional<LaunchEnv> parse_launch_env(const VarMap& vars) {
    std::optional<LaunchEnv> env;
    if (find(vars, "RANK") != nullptr || find(vars, "WORLD_SIZE") != nullptr) {
        // Half of torchrun's pair beside srun's complete set: a script exported WORLD_SIZE for torch's env:// and ran
        // the program with srun.
        const bool has_rank = find(vars, "RANK") != nullptr, has_size = find(vars, "WORLD_SIZE") != nullptr;
        const char* set = has_rank ? "RANK" : "WORLD_SIZE";
        WEFT_CHECK((has_rank && has_size) || find(vars, "SLURM_PROCID") == nullptr,
                   set << " is set but " << (has_rank ? "WORLD_SIZE" : "RANK")
                       << " is not, and SLURM_PROCID is set: unset " << set
                       << " to use srun's variables, or set both for torchrun's");
        env = parse_torchrun(vars);
    } else if (find(vars, "OMPI_COMM_WORLD_RANK") != nullptr || find(vars, "OMPI_COMM_WORLD_SIZE") != nullptr) {
        env = parse_ompi(vars);
    } else if (find(vars, "SLURM_PROCID") != nullptr) {
        if (is_slurm_batch_step(vars)) {
            refuse_batch_step_of_several_tasks(vars);
            return std::nullopt;
        }
        env = parse_slurm(vars);
        refuse_foreign_launcher(vars, env->num_ranks, env->rank);
    } else {
        refuse_foreign_launcher(vars, 0, -1);
        return std::nullopt;
    }
    if (const std::string* token = find(vars, "WEFT_JOB_TOKEN")) env->job_token = *token;
    if (const std::string* port = find(vars, "WEFT_STORE_PORT")) env->store_port = parse_port(*port, "WEFT_STORE_PORT");
    return env;
}

std::optional<LaunchEnv> detect_launch_env() {
    VarMap vars;
    for (char** p = environ; p != nullptr && *p != nullptr; ++p) {
        std::string entry(*p);
        size_t eq = entry.find('=');
        if (eq == std::string::npos) continue;
        vars.emplace(entry.substr(0, eq), entry.substr(eq + 1));
    }
    return parse_launch_env(vars);
}

}  // namespace weft
