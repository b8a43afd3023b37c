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
    std::string master_addr;  ///< rendezvous host (rank 0 hosts the store there)
    int master_port = 0;      ///< rendezvous port; 0 only when num_ranks == 1 (rank 0 then picks one)
    std::string job_token;    ///< WEFT_JOB_TOKEN; empty if none
    std::string launcher;     ///< "weftrun" | "torchrun" | "mpirun" | "srun"
};

/// Pure parser (no process state) from a name -> value map. The first family present wins:
///   1. RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (weftrun, torchrun);
///      launcher is "weftrun" when WEFT_JOB_TOKEN is set and TORCHELASTIC_RUN_ID is not, else "torchrun".
///   2. OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE (Open MPI's mpirun).
///   3. SLURM_PROCID, SLURM_STEP_NUM_TASKS | SLURM_NTASKS | SLURM_NPROCS, SLURM_LOCALID,
///      SLURM_STEP_TASKS_PER_NODE | SLURM_TASKS_PER_NODE | SLURM_NTASKS_PER_NODE with SLURM_NODEID (srun).
/// MASTER_ADDR defaults to 127.0.0.1 when every rank is on this host (an error otherwise, except under
/// Slurm, where the first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is used). For mpirun and srun
/// MASTER_PORT defaults to derived_master_port(job id) (see below). WEFT_JOB_TOKEN is read in every case.
/// Returns nullopt when no family is present; throws weft::Error naming the variable when one is present
/// but malformed or inconsistent (e.g. RANK >= WORLD_SIZE, a missing WORLD_SIZE, a port out of range).
std::optional<LaunchEnv> parse_launch_env(const std::map<std::string, std::string>& vars);

/// parse_launch_env() over this process's environment.
std::optional<LaunchEnv> detect_launch_env();

/// The rendezvous port used by mpirun / srun jobs that do not set MASTER_PORT: 20000 + hash(job_id) mod 12768
/// (64-bit FNV-1a, then splitmix64's finaliser), i.e. in [20000, 32767], below Linux's default ephemeral range so it rarely collides with a port in
/// use. Every rank of a job computes the same value from the same job id.
int derived_master_port(const std::string& job_id);

/// The first host name of a Slurm host list: "gpu[03-05,9],cpu1" -> "gpu03". Throws on an empty list.
std::string first_slurm_host(const std::string& host_list);

}  // namespace weft
