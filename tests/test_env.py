import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpctrain.core import env as env_module
from hpctrain.core.env import (
    ClusterEnv,
    EnvError,
    detect,
    expand_nodelist,
    init_distributed,
    port_from_job_id,
    teardown,
)
from tests.dist_utils import free_port


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
    from hpctrain.core.env import check_gpus_per_node

    check_gpus_per_node(2, 2, "nccl")
    check_gpus_per_node(4, 1, "gloo")  # gloo may share a GPU
    with pytest.raises(EnvError, match="2 ranks on this node but 1 GPU"):
        check_gpus_per_node(2, 1, "nccl")


# ---------------------------------------------------------------- a group someone else started


class _Group:
    """What detect() asks of a running default group: its rank and size."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world


@pytest.fixture
def running_group(monkeypatch):
    """Pretend a process group of (rank, world) is running."""
    def start(rank: int, world: int) -> None:
        monkeypatch.setattr(env_module, "_running_group", lambda: _Group(rank, world))
    return start


def test_fabric_launcher_without_rank_reads_the_group(running_group):
    """Lightning Fabric's launcher sets LOCAL_RANK, NODE_RANK and WORLD_SIZE, never RANK."""
    running_group(1, 2)
    env = detect({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "7"})
    assert env == ClusterEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
                             master_addr="h", master_port=7, source="group")


def test_a_group_wins_over_launcher_variables_and_takes_per_host_values_from_them(running_group):
    running_group(5, 8)
    env = detect({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == \
        (5, 8, 1, 4, 1, 2)
    assert env.source == "group"


def test_a_group_inside_srun_takes_per_host_values_from_slurm(running_group):
    running_group(5, 8)
    env = detect(slurm_vars())
    assert (env.local_rank, env.local_world_size, env.node_rank, env.num_nodes, env.job_id) == (1, 4, 1, 2, "4242")


def test_a_group_without_variables_is_one_host(running_group):
    running_group(3, 4)
    env = detect({})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (3, 3, 4, 4, 0)


def test_a_group_on_several_hosts_without_ranks_per_host_says_what_to_set(running_group):
    running_group(2, 4)
    with pytest.raises(EnvError, match="LOCAL_WORLD_SIZE"):
        detect({"LOCAL_RANK": "0", "NODE_RANK": "1"})


def test_detect_imports_no_torch():
    """Every command calls detect(): a login node's `hpctrain slurm` must not pay for torch."""
    code = "import sys; from hpctrain.core.env import detect; detect(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _user_group_rank(rank: int, world: int, port: int, queue) -> None:
    """What mp.spawn users write: MASTER_ADDR/PORT, an explicit rank, no RANK or WORLD_SIZE."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    env = detect()
    init_distributed(env, "gloo")  # uses the running group: a second init would raise
    teardown()  # not hpctrain's group: it keeps running
    total = torch.ones(1)
    dist.all_reduce(total)
    # the next group's port, picked just before use (a port picked at the start could be taken
    # by another test's ranks while these import torch)
    second = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(second)
    dist.destroy_process_group()
    ours = ClusterEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                      master_addr="127.0.0.1", master_port=second[0], source="slurm")
    init_distributed(ours, "gloo")
    teardown()  # hpctrain's own group: ended
    queue.put((rank, env, total.item(), dist.is_initialized()))


def _spawn_user_group(queue) -> None:
    """The two ranks; once more with fresh ports if the first try lost a port race (a port that
    free_port() picked can be bound by another test's ranks before these bind it: the gloo mesh
    or store then fails to connect, which is not what this test is about)."""
    for attempt in (1, 2):
        try:
            mp.spawn(_user_group_rank, args=(2, free_port(), queue), nprocs=2, join=True)
            return
        except mp.ProcessRaisedException as err:
            if attempt == 2 or not re.search(r"connectFullMesh failed|Connection (closed|reset|refused)|"
                                             r"address already in use", str(err), re.IGNORECASE):
                raise
            while not queue.empty():  # a rank that got through the first try
                queue.get()


def test_detect_and_teardown_respect_a_group_the_user_started():
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    _spawn_user_group(queue)
    results = {r: rest for r, *rest in (queue.get() for _ in range(2))}
    for rank, (env, total, still_running) in results.items():
        assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (rank, 2, rank, 2)
        assert env.source == "group"
        assert total == 2.0 and not still_running
