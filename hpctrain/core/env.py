"""Where am I running? One place turns a running process group or torchrun / Slurm /
plain-process variables into a :class:`ClusterEnv` value that every other module receives;
nothing else reads RANK.

torch is imported only by the functions that touch devices or the process group: every
command calls :func:`detect` (``hpctrain slurm --dry-run`` on a login node too), and it
needs none.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from hpctrain.core.errors import UserError

if TYPE_CHECKING:
    import torch

# group: a process group was already running when detect() looked (Lightning Fabric,
# Accelerate, a user's own init_process_group); its rank and size are the truth.
Source = Literal["single", "torchrun", "slurm", "group"]


class EnvError(UserError):
    """The launcher's variables contradict each other; the message names them."""


@dataclass(frozen=True)
class ClusterEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: Source = "single"
    job_id: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect(environ: Mapping[str, str] | None = None) -> ClusterEnv:
    """A running process group wins (see :func:`_from_group`); then torchrun's variables
    over Slurm's (srun + torchrun sets both); then srun tasks; else one process."""
    env = os.environ if environ is None else environ
    group = _running_group()
    if group is not None:
        return _from_group(env, group.get_rank(), group.get_world_size())
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env and _inside_srun_step(env):
        return _from_slurm(env)
    return ClusterEnv(job_id=env.get("SLURM_JOB_ID"))


def launched_rank(environ: Mapping[str, str] | None = None) -> int:
    """The rank torchrun gave this process (0 when none did), without :func:`detect`'s checks:
    the name of its per-rank files in the launcher's directories (hpctrain.core.protocol)."""
    return _int(os.environ if environ is None else environ, "RANK", 0)


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """Which attempt of torchrun's elastic agent this process belongs to (0: the first)."""
    return _int(os.environ if environ is None else environ, "TORCHELASTIC_RESTART_COUNT", 0)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None:
        if default is None:
            raise EnvError(f"{name} is not set but the launcher variables around it are; "
                           "hint: launch with torchrun or srun")
        return default
    try:
        return int(text)
    except ValueError:
        raise EnvError(f"{name}={text!r} is not an integer") from None


def _from_torchrun(env: Mapping[str, str]) -> ClusterEnv:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK", 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    _check_ranks(rank, world, "RANK", "WORLD_SIZE")
    _check_ranks(local_rank, local_world, "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if world % local_world:
        raise EnvError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}")
    return ClusterEnv(
        rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", rank // local_world), num_nodes=world // local_world,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT", 29500),
        source="torchrun", job_id=env.get("SLURM_JOB_ID"),
    )


def _running_group() -> ModuleType | None:
    """``torch.distributed`` when its default group is initialised, else None. Nothing can
    have started a group without importing torch.distributed, so asking sys.modules keeps
    detect() from importing torch for the commands that never use it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist


def _from_group(env: Mapping[str, str], rank: int, world: int) -> ClusterEnv:
    """A group someone else started: Lightning Fabric's launcher (it sets LOCAL_RANK, NODE_RANK
    and WORLD_SIZE but no RANK), Accelerate, or ``mp.spawn`` + ``init_process_group(rank=...)``
    with no variables at all. Rank and size come from the group; the per-host values from
    :func:`_per_host`."""
    local_rank, local_world, node_rank = _per_host(env, rank, world)
    return ClusterEnv(
        rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world, node_rank=node_rank,
        num_nodes=world // local_world, master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", 29500), source="group", job_id=env.get("SLURM_JOB_ID"),
    )


def _per_host(env: Mapping[str, str], rank: int, world: int) -> tuple[int, int, int]:
    """(local rank, ranks per host, node rank) of a running group: from the launcher's variables
    where there are any (torchrun's, Fabric's NODE_RANK, else Slurm's inside an srun step), else
    one host. Not counted through the group: that is a collective, and detect() stays a local
    read that any rank may call alone. A group over several hosts started without such
    variables must set LOCAL_RANK and LOCAL_WORLD_SIZE; the error says so where it can tell."""
    srun = "SLURM_PROCID" in env and _inside_srun_step(env)
    local_rank = _first_int(env, ("LOCAL_RANK", "SLURM_LOCALID") if srun else ("LOCAL_RANK",), rank)
    local_world = _first_int(env, ("LOCAL_WORLD_SIZE",),
                             _local_tasks(env, world, _int(env, "SLURM_NNODES", 1)) if srun else world)
    _check_ranks(local_rank, local_world, "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    nodes = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID") if srun else ("GROUP_RANK", "NODE_RANK")
    node_rank = _first_int(env, nodes, rank // local_world)
    if world % local_world or node_rank >= world // local_world:
        raise EnvError(f"rank {rank} of the running process group ({world} ranks) is on node {node_rank}, but "
                       f"{local_world} ranks per host do not make that many nodes; hint: set LOCAL_WORLD_SIZE "
                       "(ranks per host) and LOCAL_RANK when a group spans several hosts")
    return local_rank, local_world, node_rank


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    """The first of ``names`` that is set, as an int; ``default`` when none is."""
    return next((_int(env, name) for name in names if name in env), default)


def _inside_srun_step(env: Mapping[str, str]) -> bool:
    # A batch script also carries SLURM_PROCID=0 and SLURM_NTASKS=N, but it is ONE process:
    # only srun-launched tasks get a step id (the batch step has none or "batch").
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return step is not None and step not in ("batch", "4294967294")


def _from_slurm(env: Mapping[str, str]) -> ClusterEnv:
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    local_rank = _int(env, "SLURM_LOCALID", 0)
    num_nodes = _int(env, "SLURM_NNODES", _int(env, "SLURM_JOB_NUM_NODES", 1))
    _check_ranks(rank, world, "SLURM_PROCID", "SLURM_NTASKS")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise EnvError("SLURM_JOB_NODELIST is not set; hint: run under srun inside an allocation")
    job_id = env.get("SLURM_JOB_ID", "0")
    return ClusterEnv(
        rank=rank, local_rank=local_rank, world_size=world,
        local_world_size=_local_tasks(env, world, num_nodes), node_rank=_int(env, "SLURM_NODEID", 0),
        num_nodes=num_nodes, master_addr=env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
        master_port=_int(env, "MASTER_PORT", port_from_job_id(job_id)), source="slurm", job_id=job_id,
    )


def _local_tasks(env: Mapping[str, str], world: int, num_nodes: int) -> int:
    # SLURM_TASKS_PER_NODE looks like "4(x2),3": the first entry is this layout's widest node.
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if text:
        return int(text.split("(")[0].split(",")[0])
    return max(1, world // max(1, num_nodes))


def _check_ranks(rank: int, size: int, rank_name: str, size_name: str) -> None:
    if size < 1:
        raise EnvError(f"{size_name}={size} must be >= 1")
    if not 0 <= rank < size:
        raise EnvError(f"{rank_name}={rank} is outside 0..{size - 1} given by {size_name}={size}")


def port_from_job_id(job_id: str) -> int:
    """A port every task of one job derives alike; jobs sharing a node rarely collide."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 15000 + int(digits[-4:]) % 20000


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compact host list: ``gpu[01-04,07],cpu3`` -> gpu01..gpu04, gpu07, cpu3."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        match = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for head in _expand_ranges(ranges, item):
            hosts += [prefix + head + rest for rest in (expand_nodelist(suffix) if suffix else [""])]
    if not hosts:
        raise EnvError(f"SLURM nodelist {nodelist!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    return [i.strip() for i in items if i.strip()]


def _expand_ranges(ranges: str, item: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise EnvError(f"cannot parse range {part!r} in Slurm nodelist item {item!r}")
        width = len(lo)
        out += [str(n).zfill(width) for n in range(int(lo), int(hi if sep else lo) + 1)]
    return out


# ---------------------------------------------------------------- process group


def pick_device(env: ClusterEnv) -> torch.device:
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return torch.device("cuda", env.local_rank % count)
    return torch.device("cpu")


def pick_backend(device: torch.device, requested: str = "auto") -> str:
    if requested != "auto":
        if requested == "nccl" and device.type != "cuda":
            raise EnvError("parallel.backend=nccl needs CUDA; hint: use parallel.backend=gloo on CPU")
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class _Groups:
    """Which default process group is hpctrain's to end. torch keeps the group per process, so
    this record is per process too: a group that :func:`init_distributed` found running and
    did not start (Fabric's, Accelerate's, the user's own) belongs to whoever started it, and
    :func:`teardown` leaves it to them, while every caller keeps its plain ``teardown()``."""

    started: object | None = None  # the group init_distributed created
    found: object | None = None  # one it found running and did not create
    ever_started: bool = False  # this process started a group at some point (it may be ended now)


_groups = _Groups()


def started_a_group() -> bool:
    """Did :func:`init_distributed` start a process group in this process (ended or not)?"""
    return _groups.ever_started


def init_distributed(env: ClusterEnv, backend: str = "auto", timeout_s: float = 600.0) -> torch.device:
    """Pick the device, and start the process group if there is more than one rank and no group
    is running yet. A running group is used as it is, never started twice."""
    import torch
    import torch.distributed as dist

    device = pick_device(env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        if dist.group.WORLD is not _groups.started:
            _groups.found = dist.group.WORLD
        return device
    if not env.distributed:
        return device
    chosen = pick_backend(device, backend)
    check_gpus_per_node(env.local_world_size, torch.cuda.device_count(), chosen)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=chosen, store=_attempt_store(env, timeout),
        rank=env.rank, world_size=env.world_size, timeout=timeout,
        # NCCL's eager start on this rank's GPU; a gloo group (CPU, or CUDA tensors over gloo) is bound to no
        # device: torch 2.11's DeviceMesh then splits a bound gloo group and fails ("cannot pickle _Options")
        device_id=device if chosen == "nccl" else None,
    )
    _groups.started = dist.group.WORLD
    _groups.ever_started = True
    return device


def _attempt_store(env: ClusterEnv, timeout: datetime.timedelta) -> Any:
    """torch's own rendezvous store, its keys scoped to this torchrun attempt.

    Under torchrun, env:// reuses the elastic agent's store, which outlives a restart
    (``--max-restarts``): without a scope, a restarted gloo group reads the dead attempt's
    addresses and fails with "connectFullMesh failed ... Connection refused" (2 of 3 restarts
    with torch 2.13 here). srun tasks meet over TCP."""
    import torch.distributed as dist

    url = "env://" if env.source == "torchrun" else f"tcp://{_bracket(env.master_addr)}:{env.master_port}"
    store, _, _ = next(dist.rendezvous(url, rank=env.rank, world_size=env.world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"hpctrain/attempt-{attempt}", store)


def check_gpus_per_node(local_ranks: int, gpus: int, backend: str) -> None:
    """NCCL cannot run two ranks on one GPU: it fails deep inside the first collective with
    "Duplicate GPU detected". Say so before the process group starts, with the numbers."""
    if backend == "nccl" and local_ranks > gpus:
        raise EnvError(
            f"{local_ranks} ranks on this node but {gpus} GPU(s) visible: NCCL needs one GPU per rank; "
            f"hint: start at most {gpus} processes per node (hpctrain run -n {gpus}), check "
            "CUDA_VISIBLE_DEVICES, or use parallel.backend=gloo")


def _bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def collective_device() -> torch.device:
    """Where tensors for a collective must live: the current GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def distributed(backend: str = "auto", timeout_s: float = 600.0) -> Iterator[tuple[ClusterEnv, torch.device]]:
    """``with hpctrain.distributed() as (env, device):`` -- :func:`detect`, :func:`init_distributed`
    and, on the way out (an error included), :func:`teardown` in one: the three lines every loop of
    one's own starts and ends with."""
    env = detect()
    device = init_distributed(env, backend, timeout_s)
    try:
        yield env, device
    finally:
        teardown()


def teardown() -> None:
    """End the process group unless :func:`init_distributed` found it running: one started by
    Lightning Fabric, Accelerate or the user is theirs to end."""
    dist = _running_group()
    if dist is None or dist.group.WORLD is _groups.found:
        return
    dist.destroy_process_group()
    _groups.started = None
