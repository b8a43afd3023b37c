// SPDX-License-Identifier: MIT
// Unit tests for launcher environment parsing: weftrun, torchrun, Open MPI and Slurm, good and bad.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "weft/runtime/error.hpp"
#include "weft/runtime/launch_env.hpp"

namespace weft {
namespace {

using Vars = std::map<std::string, std::string>;

/// Expects parse_launch_env(vars) to throw a weft::Error whose message names every one of `words`.
void expect_error_naming(const Vars& vars, const std::vector<std::string>& words) {
    try {
        auto env = parse_launch_env(vars);
        ADD_FAILURE() << "no error; parsed rank " << (env ? env->rank : -1);
    } catch (const Error& e) {
        std::string what = e.what();
        for (const std::string& w : words) EXPECT_NE(what.find(w), std::string::npos) << "'" << w << "' not in: " << what;
    }
}

TEST(LaunchEnv, NoneWhenNoLauncherVariables) {
    EXPECT_FALSE(parse_launch_env({}).has_value());
    EXPECT_FALSE(parse_launch_env({{"PATH", "/bin"}, {"WEFT_JOB_TOKEN", "abc"}, {"LOCAL_RANK", "0"}}).has_value());
}

TEST(LaunchEnv, Weftrun) {
    Vars v = {{"RANK", "2"},         {"WORLD_SIZE", "3"},          {"LOCAL_RANK", "2"},
              {"LOCAL_WORLD_SIZE", "3"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29517"},
              {"WEFT_JOB_TOKEN", "f00d"}, {"WEFT_RUN_ID", "5eed"}};
    auto e = parse_launch_env(v);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->launcher, "weftrun");
    EXPECT_EQ(e->rank, 2);
    EXPECT_EQ(e->num_ranks, 3);
    EXPECT_EQ(e->local_rank, 2);
    EXPECT_EQ(e->local_num_ranks, 3);
    EXPECT_EQ(e->master_addr, "127.0.0.1");
    EXPECT_EQ(e->master_port, 29517);
    EXPECT_EQ(e->store_port, 0);
    EXPECT_EQ(e->job_token, "f00d");
    EXPECT_EQ(e->job_id, "weftrun 5eed");  // the run id names the job, not the secret token
    // Without a run id the job is named by its rendezvous address.
    v.erase("WEFT_RUN_ID");
    EXPECT_EQ(parse_launch_env(v)->job_id, "MASTER 127.0.0.1:29517");
    EXPECT_EQ(parse_launch_env(v)->launcher, "weftrun");
}

TEST(LaunchEnv, TorchrunMultiNode) {
    Vars v = {{"RANK", "13"},          {"WORLD_SIZE", "16"},      {"LOCAL_RANK", "5"},
              {"LOCAL_WORLD_SIZE", "8"}, {"MASTER_ADDR", "node-a"}, {"MASTER_PORT", "29500"},
              {"TORCHELASTIC_RUN_ID", "x"}, {"WEFT_JOB_TOKEN", "t"}};
    auto e = parse_launch_env(v);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->launcher, "torchrun");  // torchrun wins over the token
    EXPECT_EQ(e->rank, 13);
    EXPECT_EQ(e->num_ranks, 16);
    EXPECT_EQ(e->local_rank, 5);
    EXPECT_EQ(e->local_num_ranks, 8);
    EXPECT_EQ(e->master_addr, "node-a");
    EXPECT_EQ(e->master_port, 29500);
    EXPECT_EQ(e->job_token, "t");
    // The run id may be torchrun's default "none": the agent's store address (held for the job's life) completes the
    // name. Across hosts the restart count does not enter it (the agents do not agree on it).
    EXPECT_EQ(e->job_id, "torchrun x node-a:29500");
    Vars restarted = v;
    restarted["TORCHELASTIC_RESTART_COUNT"] = "2";
    EXPECT_EQ(parse_launch_env(restarted)->job_id, "torchrun x node-a:29500");
    // On one host it does: a restarted World never meets its predecessor's store.
    Vars one_host = v;
    one_host["WORLD_SIZE"] = "8";
    one_host["RANK"] = "5";
    EXPECT_EQ(parse_launch_env(one_host)->job_id, "torchrun x node-a:29500 restart 0");
    one_host["TORCHELASTIC_RESTART_COUNT"] = "2";
    EXPECT_EQ(parse_launch_env(one_host)->job_id, "torchrun x node-a:29500 restart 2");
}

TEST(LaunchEnv, TorchrunStandalone) {
    // What `torchrun --standalone --nproc_per_node=2` gives its second worker (the agent's store listens on
    // MASTER_PORT; TORCHELASTIC_USE_AGENT_STORE says the workers are its clients).
    Vars v = {{"RANK", "1"},
              {"WORLD_SIZE", "2"},
              {"LOCAL_RANK", "1"},
              {"LOCAL_WORLD_SIZE", "2"},
              {"GROUP_RANK", "0"},
              {"ROLE_RANK", "1"},
              {"MASTER_ADDR", "localhost"},
              {"MASTER_PORT", "38083"},
              {"TORCHELASTIC_RUN_ID", "8c1f5e0a-6f0e-4a57-9d43-0d1b3f0b9a11"},
              {"TORCHELASTIC_RESTART_COUNT", "0"},
              {"TORCHELASTIC_MAX_RESTARTS", "0"},
              {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
    auto e = parse_launch_env(v);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->launcher, "torchrun");
    EXPECT_EQ(e->local_num_ranks, e->num_ranks);  // one host: the store is a Unix socket (launch_store.hpp)
    EXPECT_EQ(e->master_port, 38083);
    EXPECT_EQ(e->job_id, "torchrun 8c1f5e0a-6f0e-4a57-9d43-0d1b3f0b9a11 localhost:38083 restart 0");
    EXPECT_TRUE(e->job_token.empty());
}

TEST(LaunchEnv, HandMadeEnvDefaultsToOneHost) {
    auto e = parse_launch_env({{"RANK", "1"}, {"WORLD_SIZE", "5"}, {"MASTER_PORT", "1234"}});
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->launcher, "torchrun");
    EXPECT_EQ(e->local_rank, 1);
    EXPECT_EQ(e->local_num_ranks, 5);
    EXPECT_EQ(e->master_addr, "127.0.0.1");
    EXPECT_TRUE(e->job_token.empty());
    EXPECT_EQ(e->job_id, "MASTER 127.0.0.1:1234");
    // One rank needs no port and no job id: it needs no store.
    auto single = parse_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
    ASSERT_TRUE(single.has_value());
    EXPECT_EQ(single->master_port, 0);
    EXPECT_EQ(single->job_id, "");
}

TEST(LaunchEnv, StorePortFromTheEnvironment) {
    Vars v = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}, {"WEFT_STORE_PORT", "31555"}};
    EXPECT_EQ(parse_launch_env(v)->store_port, 31555);
    EXPECT_EQ(parse_launch_env(v)->master_port, 29500);
    v["WEFT_STORE_PORT"] = "0";
    expect_error_naming(v, {"WEFT_STORE_PORT", "[1, 65535]"});
    v["WEFT_STORE_PORT"] = "port";
    expect_error_naming(v, {"WEFT_STORE_PORT", "'port'"});
    // One host meets over a Unix socket: a WEFT_STORE_PORT equal to MASTER_PORT is never bound (launch_store_address
    // refuses it where it would be: LaunchStore.*).
    v["WEFT_STORE_PORT"] = "29500";
    EXPECT_EQ(parse_launch_env(v)->store_port, 29500);
}

TEST(LaunchEnv, TorchrunInconsistentValuesNameTheVariable) {
    Vars base = {{"RANK", "1"},           {"WORLD_SIZE", "4"},         {"LOCAL_RANK", "1"},
                 {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
    auto with = [&](const std::string& k, const std::string& val) {
        Vars v = base;
        v[k] = val;
        return v;
    };
    auto without = [&](const std::string& k) {
        Vars v = base;
        v.erase(k);
        return v;
    };
    expect_error_naming(with("RANK", "4"), {"RANK", "WORLD_SIZE=4", "got 4"});
    expect_error_naming(with("RANK", "-1"), {"RANK", "got -1"});
    expect_error_naming(with("RANK", "one"), {"RANK", "'one'"});
    expect_error_naming(with("RANK", ""), {"RANK"});
    expect_error_naming(with("WORLD_SIZE", "0"), {"WORLD_SIZE", "at least 1"});
    expect_error_naming(with("WORLD_SIZE", "99999999999"), {"WORLD_SIZE", "out of range"});
    expect_error_naming(with("LOCAL_RANK", "4"), {"LOCAL_RANK", "LOCAL_WORLD_SIZE=4"});
    expect_error_naming(with("LOCAL_WORLD_SIZE", "5"), {"LOCAL_WORLD_SIZE", "WORLD_SIZE=4", "got 5"});
    expect_error_naming(with("LOCAL_WORLD_SIZE", "0"), {"LOCAL_WORLD_SIZE"});
    expect_error_naming(with("MASTER_PORT", "0"), {"MASTER_PORT", "[1, 65535]"});
    expect_error_naming(with("MASTER_PORT", "70000"), {"MASTER_PORT", "70000"});
    expect_error_naming(with("MASTER_PORT", "29500x"), {"MASTER_PORT"});
    expect_error_naming(with("MASTER_ADDR", ""), {"MASTER_ADDR", "empty"});
    expect_error_naming(without("WORLD_SIZE"), {"WORLD_SIZE", "not"});
    expect_error_naming(without("RANK"), {"RANK", "not"});
    expect_error_naming(without("MASTER_PORT"), {"MASTER_PORT", "4 ranks"});
    // Ranks on several hosts need MASTER_ADDR: 127.0.0.1 would be wrong on all but one.
    Vars multi = with("LOCAL_WORLD_SIZE", "2");
    multi["LOCAL_RANK"] = "1";
    multi.erase("MASTER_ADDR");
    expect_error_naming(multi, {"MASTER_ADDR", "several hosts"});
    // On several hosts a rank's place on its host cannot be guessed from RANK.
    Vars unplaced = with("LOCAL_WORLD_SIZE", "2");
    unplaced.erase("LOCAL_RANK");
    expect_error_naming(unplaced, {"LOCAL_RANK must be set", "LOCAL_WORLD_SIZE (2)", "WORLD_SIZE (4)"});
    // One host: LOCAL_RANK defaults to RANK.
    EXPECT_EQ(parse_launch_env(without("LOCAL_RANK"))->local_rank, 1);
}

TEST(LaunchEnv, HalfOfTorchrunsPairBesideSrunsVariablesSaysWhichToUnset) {
    const Vars srun = {{"SLURM_PROCID", "1"},          {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"},
                       {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_JOB_ID", "7"}, {"SLURM_STEP_ID", "0"}};
    Vars v = srun;
    v["WORLD_SIZE"] = "2";
    expect_error_naming(v, {"WORLD_SIZE is set but RANK is not", "SLURM_PROCID", "unset WORLD_SIZE"});
    v.erase("WORLD_SIZE");
    v["RANK"] = "1";
    expect_error_naming(v, {"RANK is set but WORLD_SIZE is not", "unset RANK"});
}

TEST(LaunchEnv, OpenMpi) {
    Vars v = {{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "6"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
              {"OMPI_COMM_WORLD_LOCAL_SIZE", "6"}, {"OMPI_MCA_ess_base_jobid", "3735552001"}};
    auto e = parse_launch_env(v);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->launcher, "mpirun");
    EXPECT_EQ(e->rank, 3);
    EXPECT_EQ(e->num_ranks, 6);
    EXPECT_EQ(e->local_rank, 3);
    EXPECT_EQ(e->local_num_ranks, 6);
    EXPECT_EQ(e->master_addr, "127.0.0.1");
    EXPECT_EQ(e->master_port, 0);  // mpirun sets none, and weft needs none
    // Every rank reads the same job id; another job has another.
    EXPECT_EQ(e->job_id, "OMPI_MCA_ess_base_jobid=3735552001");
    Vars other_rank = v;
    other_rank["OMPI_COMM_WORLD_RANK"] = "0";
    other_rank["OMPI_COMM_WORLD_LOCAL_RANK"] = "0";
    EXPECT_EQ(parse_launch_env(other_rank)->job_id, e->job_id);
    Vars other_job = v;
    other_job["OMPI_MCA_ess_base_jobid"] = "3735552002";
    EXPECT_NE(parse_launch_env(other_job)->job_id, e->job_id);
    // Open MPI 5 has no ess jobid but a PMIx namespace.
    Vars pmix = v;
    pmix.erase("OMPI_MCA_ess_base_jobid");
    pmix["PMIX_NAMESPACE"] = "prterun-host-4242@1";
    EXPECT_EQ(parse_launch_env(pmix)->job_id, "PMIX_NAMESPACE=prterun-host-4242@1");
    // MASTER_ADDR / MASTER_PORT from the environment are read (the job id stays Open MPI's).
    Vars given = v;
    given["MASTER_ADDR"] = "10.0.0.7";
    given["MASTER_PORT"] = "40001";
    given["OMPI_COMM_WORLD_LOCAL_SIZE"] = "3";
    given["OMPI_COMM_WORLD_LOCAL_RANK"] = "0";
    auto g = parse_launch_env(given);
    EXPECT_EQ(g->master_addr, "10.0.0.7");
    EXPECT_EQ(g->master_port, 40001);
    EXPECT_EQ(g->local_num_ranks, 3);
    EXPECT_EQ(g->job_id, e->job_id);
}

TEST(LaunchEnv, OpenMpiInconsistentValuesNameTheVariable) {
    Vars base = {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                 {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_MCA_ess_base_jobid", "77"}};
    Vars v = base;
    v["OMPI_COMM_WORLD_RANK"] = "2";
    expect_error_naming(v, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE=2"});
    v = base;
    v.erase("OMPI_COMM_WORLD_LOCAL_SIZE");
    expect_error_naming(v, {"OMPI_COMM_WORLD_LOCAL_SIZE", "not"});
    v = base;
    v["OMPI_COMM_WORLD_LOCAL_RANK"] = "2";
    expect_error_naming(v, {"OMPI_COMM_WORLD_LOCAL_RANK"});
    v = base;
    v.erase("OMPI_MCA_ess_base_jobid");
    expect_error_naming(v, {"MASTER_PORT", "job id"});
    v = base;
    v["OMPI_COMM_WORLD_LOCAL_SIZE"] = "1";
    v["OMPI_COMM_WORLD_LOCAL_RANK"] = "0";
    expect_error_naming(v, {"MASTER_ADDR"});  // two hosts, no address
}

TEST(LaunchEnv, LaunchersWeftDoesNotReadAreRefusedNotTakenAsOneRank) {
    for (const char* name : {"PMI_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"}) {
        Vars v = {{name, "4"}, {"PMI_RANK", "1"}};
        expect_error_naming(v, {name, "weftrun"});
        v[name] = "1";  // one process: nothing to meet
        EXPECT_FALSE(parse_launch_env(v).has_value()) << name;
    }
    // Hydra inside a Slurm allocation: its ranks inherit the srun-started proxy's variables (rank 0 of one task).
    Vars hydra = {{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "1"}, {"SLURM_LOCALID", "0"}, {"SLURM_NNODES", "1"},
                  {"SLURM_JOB_ID", "7"}, {"SLURM_STEP_ID", "0"},        {"PMI_SIZE", "8"},      {"PMI_RANK", "3"}};
    expect_error_naming(hydra, {"PMI_SIZE", "rank 0 of 1 task(s)", "weftrun"});
    // mpiexec inside a batch script of as many tasks: the batch step's SLURM_PROCID (0) on every rank.
    Vars batch = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "0"}, {"SLURM_NNODES", "1"},
                  {"SLURM_JOB_ID", "7"}, {"PMI_SIZE", "8"},     {"PMI_RANK", "5"}};
    expect_error_naming(batch, {"PMI_SIZE", "rank 0 of 8 task(s)"});
    // srun --mpi=pmi2 sets PMI_SIZE to its own task count: srun's launch, read as such.
    Vars pmi2 = {{"SLURM_PROCID", "3"}, {"SLURM_STEP_NUM_TASKS", "8"}, {"SLURM_LOCALID", "3"}, {"SLURM_NNODES", "1"},
                 {"SLURM_JOB_ID", "7"}, {"SLURM_STEP_ID", "0"},        {"PMI_SIZE", "8"},      {"PMI_RANK", "3"}};
    auto e = parse_launch_env(pmi2);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->launcher, "srun");
    EXPECT_EQ(e->rank, 3);
    EXPECT_EQ(e->num_ranks, 8);
}

TEST(LaunchEnv, ABatchScriptsOwnProcessIsNotReadAsRankZeroOfTheJob) {
    // sbatch --ntasks=4 with ./prog run straight from the script: the batch step's variables, no srun step.
    Vars batch = {{"SLURM_PROCID", "0"},    {"SLURM_NTASKS", "4"},        {"SLURM_LOCALID", "0"},
                  {"SLURM_NNODES", "1"},    {"SLURM_JOB_ID", "11"},       {"SLURM_NODEID", "0"},
                  {"ENVIRONMENT", "BATCH"}, {"SLURM_TASKS_PER_NODE", "4"}};
    expect_error_naming(batch, {"batch script", "SLURM_NTASKS=4", "srun ./prog"});
    Vars batch_step_id = batch;
    batch_step_id["SLURM_STEP_ID"] = "4294967294";  // Slurm's batch step id
    expect_error_naming(batch_step_id, {"batch script", "SLURM_NTASKS=4"});
    // A batch script of one task (or none counted) is a job of one rank.
    Vars one = batch;
    one["SLURM_NTASKS"] = "1";
    EXPECT_FALSE(parse_launch_env(one).has_value());
    one.erase("SLURM_NTASKS");
    EXPECT_FALSE(parse_launch_env(one).has_value());
    // srun inside the script: its tasks inherit ENVIRONMENT=BATCH and carry the step's variables.
    Vars step = batch;
    step["SLURM_STEP_ID"] = "0";
    step["SLURM_STEP_NUM_TASKS"] = "4";
    step["SLURM_PROCID"] = "2";
    step["SLURM_LOCALID"] = "2";
    auto e = parse_launch_env(step);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->launcher, "srun");
    EXPECT_EQ(e->rank, 2);
    EXPECT_EQ(e->num_ranks, 4);
    // mpiexec (Hydra) inside the batch script: refused as a launcher weft does not read.
    Vars hydra = batch;
    hydra["PMI_SIZE"] = "4";
    hydra["PMI_RANK"] = "3";
    expect_error_naming(hydra, {"PMI_SIZE", "rank 0 of 4 task(s)"});
}

TEST(LaunchEnv, SlurmSingleNode) {
    Vars v = {{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "2"}, {"SLURM_NNODES", "1"},
              {"SLURM_JOB_ID", "98765"}, {"SLURM_STEP_ID", "0"}};
    auto e = parse_launch_env(v);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->launcher, "srun");
    EXPECT_EQ(e->rank, 2);
    EXPECT_EQ(e->num_ranks, 4);
    EXPECT_EQ(e->local_rank, 2);
    EXPECT_EQ(e->local_num_ranks, 4);
    EXPECT_EQ(e->master_addr, "127.0.0.1");
    EXPECT_EQ(e->master_port, 0);
    EXPECT_EQ(e->job_id, "SLURM_JOB_ID=98765.0");
    // Another step of the same job is another job.
    Vars step1 = v;
    step1["SLURM_STEP_ID"] = "1";
    EXPECT_EQ(parse_launch_env(step1)->job_id, "SLURM_JOB_ID=98765.1");
    // A torch.distributed process group in the same job sets MASTER_PORT: read, and the job id stays Slurm's.
    Vars with_torch = v;
    with_torch["MASTER_PORT"] = "29500";
    EXPECT_EQ(parse_launch_env(with_torch)->master_port, 29500);
    EXPECT_EQ(parse_launch_env(with_torch)->job_id, e->job_id);
}

TEST(LaunchEnv, SlurmMultiNode) {
    // 7 tasks over 3 nodes as "3(x2),1"; this task is on the third node (one task there).
    Vars v = {{"SLURM_PROCID", "6"},      {"SLURM_STEP_NUM_TASKS", "7"},  {"SLURM_NTASKS", "99"},
              {"SLURM_LOCALID", "0"},     {"SLURM_NODEID", "2"},          {"SLURM_STEP_TASKS_PER_NODE", "3(x2),1"},
              {"SLURM_JOB_ID", "5"},      {"SLURM_STEP_NODELIST", "gpu[07-09]"}};
    auto e = parse_launch_env(v);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->num_ranks, 7);  // the step's count wins over the job's
    EXPECT_EQ(e->local_num_ranks, 1);
    EXPECT_EQ(e->master_addr, "gpu07");
    EXPECT_EQ(e->job_id, "SLURM_JOB_ID=5.");
    // On the first node.
    v["SLURM_PROCID"] = "1";
    v["SLURM_LOCALID"] = "1";
    v["SLURM_NODEID"] = "0";
    e = parse_launch_env(v);
    EXPECT_EQ(e->local_num_ranks, 3);
    EXPECT_EQ(e->local_rank, 1);
    // MASTER_ADDR overrides the node list.
    v["MASTER_ADDR"] = "10.1.2.3";
    EXPECT_EQ(parse_launch_env(v)->master_addr, "10.1.2.3");
    // --ntasks-per-node style.
    Vars fixed = {{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                  {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_JOB_NODELIST", "a1,b2"}, {"SLURM_JOB_ID", "1"}};
    auto f = parse_launch_env(fixed);
    EXPECT_EQ(f->local_num_ranks, 4);
    EXPECT_EQ(f->master_addr, "a1");
}

TEST(LaunchEnv, SlurmInconsistentValuesNameTheVariable) {
    Vars base = {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                 {"SLURM_TASKS_PER_NODE", "2(x2)"}, {"SLURM_NODEID", "0"}, {"SLURM_JOB_ID", "9"},
                 {"SLURM_JOB_NODELIST", "n[1-2]"}};
    ASSERT_TRUE(parse_launch_env(base).has_value());
    Vars v = base;
    v["SLURM_PROCID"] = "4";
    expect_error_naming(v, {"SLURM_PROCID", "SLURM_NTASKS=4"});
    v = base;
    v.erase("SLURM_NTASKS");
    expect_error_naming(v, {"SLURM_NTASKS"});
    v = base;
    v["SLURM_LOCALID"] = "2";
    expect_error_naming(v, {"SLURM_LOCALID", "SLURM_TASKS_PER_NODE=2"});
    v = base;
    v["SLURM_TASKS_PER_NODE"] = "2(x)";
    expect_error_naming(v, {"SLURM_TASKS_PER_NODE", "2(x)"});
    v = base;
    v["SLURM_TASKS_PER_NODE"] = "2,,2";
    expect_error_naming(v, {"SLURM_TASKS_PER_NODE"});
    v = base;
    v["SLURM_NODEID"] = "2";
    expect_error_naming(v, {"SLURM_NODEID", "2(x2)"});
    v = base;
    v.erase("SLURM_NODEID");
    expect_error_naming(v, {"SLURM_NODEID"});
    v = base;
    v.erase("SLURM_TASKS_PER_NODE");
    expect_error_naming(v, {"SLURM_TASKS_PER_NODE"});
    v = base;
    v.erase("SLURM_JOB_ID");
    expect_error_naming(v, {"MASTER_PORT", "SLURM_JOB_ID"});
    v = base;
    v["SLURM_LOCALID"] = "x";
    expect_error_naming(v, {"SLURM_LOCALID", "'x'"});
}

TEST(LaunchEnv, PrecedenceWhenLaunchersNest) {
    // torchrun inside a Slurm allocation: RANK & co. describe this process.
    Vars v = {{"RANK", "0"},        {"WORLD_SIZE", "2"},   {"MASTER_PORT", "29500"},
              {"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "1"}, {"OMPI_COMM_WORLD_RANK", "9"}};
    EXPECT_EQ(parse_launch_env(v)->launcher, "torchrun");
    // mpirun inside Slurm: Open MPI's variables win over Slurm's.
    v.erase("RANK");
    v.erase("WORLD_SIZE");
    v["OMPI_COMM_WORLD_RANK"] = "1";
    v["OMPI_COMM_WORLD_SIZE"] = "2";
    v["OMPI_COMM_WORLD_LOCAL_RANK"] = "1";
    v["OMPI_COMM_WORLD_LOCAL_SIZE"] = "2";
    v["SLURM_JOB_ID"] = "12";
    auto e = parse_launch_env(v);
    EXPECT_EQ(e->launcher, "mpirun");
    EXPECT_EQ(e->rank, 1);
    EXPECT_EQ(e->master_port, 29500);
}

TEST(LaunchEnv, DerivedPortIsStableAndInRange) {
    std::set<int> seen;
    for (int job = 0; job < 2000; ++job) {
        int p = derived_master_port(std::to_string(job));
        ASSERT_GE(p, 20000);
        ASSERT_LE(p, 32767);
        seen.insert(p);
    }
    // Spread like a uniform hash: 2000 ids into 12768 ports leave ~1851 distinct ones (sd ~ 10).
    EXPECT_GT(seen.size(), 1800u);
    EXPECT_EQ(derived_master_port("job-1"), derived_master_port("job-1"));
}

TEST(LaunchEnv, FirstSlurmHost) {
    EXPECT_EQ(first_slurm_host("node1"), "node1");
    EXPECT_EQ(first_slurm_host("gpu[03-05,9],cpu1"), "gpu03");
    EXPECT_EQ(first_slurm_host("a,b"), "a");
    EXPECT_EQ(first_slurm_host("rack[2-3]-n[10,12]"), "rack2-n10");
    EXPECT_EQ(first_slurm_host("x[7]"), "x7");
    EXPECT_THROW(first_slurm_host(""), Error);
    EXPECT_THROW(first_slurm_host("n[1-2"), Error);
    EXPECT_THROW(first_slurm_host("n[]"), Error);
    EXPECT_THROW(first_slurm_host(",a"), Error);
}

/// Sets variables for the scope of a test and restores the previous environment afterwards.
class ScopedEnv {
public:
    void set(const char* name, const char* value) {
        remember(name);
        ::setenv(name, value, 1);
    }
    void unset(const char* name) {
        remember(name);
        ::unsetenv(name);
    }
    ~ScopedEnv() {
        for (auto& [name, old] : saved_) {
            if (old.second) {
                ::setenv(name.c_str(), old.first.c_str(), 1);
            } else {
                ::unsetenv(name.c_str());
            }
        }
    }

private:
    void remember(const char* name) {
        if (saved_.count(name)) return;
        const char* v = std::getenv(name);
        saved_[name] = {v ? v : "", v != nullptr};
    }
    std::map<std::string, std::pair<std::string, bool>> saved_;
};

TEST(LaunchEnv, DetectReadsTheProcessEnvironment) {
    ScopedEnv env;
    env.set("RANK", "1");
    env.set("WORLD_SIZE", "2");
    env.set("LOCAL_RANK", "1");
    env.set("LOCAL_WORLD_SIZE", "2");
    env.set("MASTER_ADDR", "127.0.0.1");
    env.set("MASTER_PORT", "31001");
    env.set("WEFT_JOB_TOKEN", "secret=with=equals");
    env.unset("TORCHELASTIC_RUN_ID");
    env.set("WEFT_RUN_ID", "abc");
    env.set("WEFT_STORE_PORT", "31002");
    auto e = detect_launch_env();
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->launcher, "weftrun");
    EXPECT_EQ(e->rank, 1);
    EXPECT_EQ(e->master_port, 31001);
    EXPECT_EQ(e->store_port, 31002);
    EXPECT_EQ(e->job_id, "weftrun abc");
    EXPECT_EQ(e->job_token, "secret=with=equals");
    env.set("RANK", "2");
    EXPECT_THROW(detect_launch_env(), Error);
}

}  // namespace
}  // namespace weft
