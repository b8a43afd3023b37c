// SPDX-License-Identifier: MIT
// LaunchEnv: who this process is in a multi-process job, read from the launcher's environment variables.
#pragma once

#include <map>
#include <optional>
#include <string>

namespace weft {

/// One process's place in a job started by weftrun, torchrun, mpirun (Open MPI) or srun.
struct LaunchEnv {
    int rank = 0;             ///< this process's rank, in [0, num_ranks)
    int num_ranks = 1;        ///< processes in the job
    int local_rank = 0;       ///< rank among the processes on this host, in [0, local_num_ranks)
    int local_num_ranks = 1;  ///< processes on this host
    std::string master_addr;  ///< rank 0's host: where the store listens when the ranks span several hosts
    /// The launcher's MASTER_PORT, 0 when unset. weft never listens on it: it belongs to the launcher (torchrun's
    /// agent serves its own store there) or to torch.distributed's store in the same job.
    int master_port = 0;
    int store_port = 0;       ///< WEFT_STORE_PORT, 0 when unset: the store's TCP port when ranks span several hosts
    /// Names the job among the jobs running on its hosts, the same string on every rank; not a secret (it
    /// names the store's socket). Empty only for a job of one rank. See parse_launch_env.
    std::string job_id;
    std::string job_token;    ///< WEFT_JOB_TOKEN; empty if none
    std::string launcher;     ///< "weftrun" | "torchrun" | "mpirun" | "srun"
};

/// Pure parser (no process state) from a name -> value map. The first family present wins:
///   1. RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (weftrun, torchrun);
///      launcher is "torchrun" when TORCHELASTIC_RUN_ID is set, else "weftrun" when WEFT_RUN_ID or
///      WEFT_JOB_TOKEN is, else "torchrun" (a hand-made environment, as torch.distributed's env:// reads it).
///   2. OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE (Open MPI's mpirun).
///   3. SLURM_PROCID, SLURM_STEP_NUM_TASKS | SLURM_NTASKS | SLURM_NPROCS, SLURM_LOCALID,
///      SLURM_STEP_TASKS_PER_NODE | SLURM_TASKS_PER_NODE | SLURM_NTASKS_PER_NODE with SLURM_NODEID (srun).
///      A batch script's own process (ENVIRONMENT=BATCH and no SLURM_STEP_ID / SLURM_STEP_NUM_TASKS) is no srun
///      task: nullopt for a job of one task, an error naming srun for more.
/// MASTER_ADDR defaults to 127.0.0.1 when every rank is on this host (an error otherwise, except under
/// Slurm, where the first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is used).
/// The job id: torchrun: TORCHELASTIC_RUN_ID with MASTER_ADDR:MASTER_PORT (the agent's store, held for the
/// job's life) and TORCHELASTIC_RESTART_COUNT; weftrun: WEFT_RUN_ID; mpirun: OMPI_MCA_ess_base_jobid,
/// OMPI_MCA_orte_ess_jobid, PMIX_NAMESPACE or SLURM_JOB_ID.SLURM_STEP_ID; srun: SLURM_JOB_ID.SLURM_STEP_ID;
/// otherwise MASTER_ADDR:MASTER_PORT, so a job of several ranks without a job id needs MASTER_PORT.
/// WEFT_JOB_TOKEN and WEFT_STORE_PORT are read in every case.
/// Returns nullopt when no family is present; throws weft::Error naming the variable when one is present
/// but malformed or inconsistent (e.g. RANK >= WORLD_SIZE, a missing WORLD_SIZE, a port out of range).
std::optional<LaunchEnv> parse_launch_env(const std::map<std::string, std::string>& vars);

/// parse_launch_env() over this process's environment.
std::optional<LaunchEnv> detect_launch_env();

/// The store's TCP port for a job whose ranks span several hosts and which does not set WEFT_STORE_PORT:
/// 20000 + hash(key) mod 12768 (64-bit FNV-1a, then splitmix64's finaliser), i.e. in [20000, 32767], below
/// Linux's default ephemeral range so it rarely collides with a port in use. Every rank computes the same
/// value from the same key (docs/runtime.md, "Finding the store").
int derived_master_port(const std::string& key);

/// The first host name of a Slurm host list: "gpu[03-05,9],cpu1" -> "gpu03". Throws on an empty list.
std::string first_slurm_host(const std::string& host_list);

/// Whether `host` names this host's loopback by its text alone ("", "localhost", "127.*", "::1"): what a launch
/// environment's MASTER_ADDR says about the job staying on one host.
bool is_loopback_name(const std::string& host);

}  // namespace weft
