import pytest

from hpctrain.env import ClusterEnv, EnvError, detect, expand_nodelist, port_from_job_id


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_bad_nodelist_is_named():
    with pytest.raises(EnvError, match="x-y"):
        expand_nodelist("gpu[x-y]")


def test_single_process():
    assert detect({}) == ClusterEnv()


def test_torchrun():
    env = detect({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                  "GROUP_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (env.rank, env.local_rank, env.world_size, env.node_rank, env.num_nodes) == (3, 1, 4, 1, 2)
    assert (env.master_addr, env.master_port, env.source) == ("n1", 1234, "torchrun")


def test_torchrun_wins_over_slurm():
    env = detect({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "SLURM_PROCID": "5",
                  "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "a[1-2]"})
    assert env.source == "torchrun" and env.world_size == 2


def slurm_vars(**extra):
    base = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NNODES": "2",
            "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "4(x2)"}
    return {**base, **extra}


def test_srun_without_torchrun():
    env = detect(slurm_vars())
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert (env.node_rank, env.num_nodes, env.master_addr) == (1, 2, "gpu01")
    assert env.master_port == port_from_job_id("4242") and env.source == "slurm" and env.job_id == "4242"


def test_batch_script_is_one_process():
    # sbatch's batch step carries SLURM_PROCID=0 and SLURM_NTASKS=8 but is one process.
    vars_ = slurm_vars(SLURM_PROCID="0")
    del vars_["SLURM_STEP_ID"]
    env = detect(vars_)
    assert env.world_size == 1 and env.source == "single" and env.job_id == "4242"


def test_port_is_stable_and_in_range():
    assert port_from_job_id("123456") == port_from_job_id("123456")
    assert all(15000 <= port_from_job_id(str(j)) < 35000 for j in (0, 1, 99999, 12345678))


@pytest.mark.parametrize("vars_, names", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, ["RANK=2", "WORLD_SIZE=2"]),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK=3"]),
    ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x'"]),
    ({"WORLD_SIZE": "2"}, ["RANK"]),
    ({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}, ["WORLD_SIZE=3", "LOCAL_WORLD_SIZE=2"]),
])
def test_inconsistent_torchrun_settings_are_named(vars_, names):
    with pytest.raises(EnvError) as err:
        detect(vars_)
    for name in names:
        assert name in str(err.value)


def test_slurm_rank_outside_world():
    with pytest.raises(EnvError, match="SLURM_PROCID=9"):
        detect(slurm_vars(SLURM_PROCID="9"))


def test_nccl_needs_one_gpu_per_local_rank() -> None:
    from hpctrain.env import check_gpus_per_node

    check_gpus_per_node(2, 2, "nccl")
    check_gpus_per_node(4, 1, "gloo")  # gloo may share a GPU
    with pytest.raises(EnvError, match="2 ranks on this node but 1 GPU"):
        check_gpus_per_node(2, 1, "nccl")
