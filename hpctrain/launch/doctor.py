"""``hpctrain doctor``: what a job will see on this node, and the common mistakes.

Only facts that can be read honestly are reported: versions from the installed packages,
GPUs from torch, the cluster variables, the address the process group binds to, free
space and file-system type from ``/proc/mounts``. NCCL and GPU facts appear only where
CUDA is there. Warnings name the variable or path and what to do.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpctrain._version import __version__
from hpctrain.core.env import EnvError, detect

NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "cephfs", "ceph", "glusterfs", "panfs",
              "fuse.sshfs", "fuse.glusterfs", "wekafs", "9p"}
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
              "SLURM_CPUS_PER_TASK", "SLURM_GPUS_ON_NODE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
              "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "SLURM_TMPDIR", "SLURM_SUBMIT_DIR")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG",
               "NCCL_IB_DISABLE")


def versions() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "hpctrain": __version__,
                             "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a CUDA build without NCCL: just not reported
            pass
    return facts


def gpus() -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        out.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                    "capability": f"{props.major}.{props.minor}"})
    return out


def cluster(environ: Mapping[str, str]) -> dict[str, Any]:
    try:
        env = detect(environ)
    except EnvError as err:
        return {"error": str(err)}
    return {"source": env.source, "rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
            "local_world_size": env.local_world_size, "node_rank": env.node_rank, "num_nodes": env.num_nodes,
            "master": f"{env.master_addr}:{env.master_port}"}


def interfaces() -> dict[str, str]:
    """IPv4 address -> interface name, from `ip` (empty where `ip` is missing)."""
    if shutil.which("ip") is None:
        return {}
    text = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    found = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet":
            found[parts[3].split("/")[0]] = parts[1]
    return found


def network(environ: Mapping[str, str]) -> dict[str, Any]:
    """gloo and NCCL bind to the address the hostname resolves to, unless *_SOCKET_IFNAME says otherwise."""
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError as err:
        address = f"unresolvable ({err})"
    facts = {"hostname": host, "address": address, "interface": interfaces().get(address)}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if environ.get(name):
            facts[name] = environ[name]
    return facts


def filesystem(path: Path) -> dict[str, Any]:
    """Free space and file-system type of the mount that holds ``path`` (or its nearest existing parent)."""
    probe = path.resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    fstype, mount = "unknown", "/"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, point, kind = line.split()[:3]
            inside = str(probe) == point or str(probe).startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(mount):
                fstype, mount = kind, point
    except OSError:
        pass
    return {"path": str(path), "exists": path.exists(), "fstype": fstype, "mount": mount,
            "free_gib": round(usage.free / 2**30, 1), "network": fstype in NETWORK_FS or fstype.startswith("fuse.")}


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------- checks


def check_world(environ: Mapping[str, str]) -> list[str]:
    """WORLD_SIZE against the allocation: the ranks must add up to nodes x ranks per node."""
    warnings = []
    world, local, nodes = (environ.get(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NNODES"))
    if world and local and nodes and world.isdigit() and local.isdigit() and nodes.isdigit():
        if int(world) != int(local) * int(nodes):
            warnings.append(f"WORLD_SIZE={world} but SLURM_NNODES={nodes} x LOCAL_WORLD_SIZE={local} = "
                            f"{int(nodes) * int(local)}; hint: one `hpctrain run` (or torchrun) per node, "
                            "--nnodes equal to the allocation's nodes")
    ntasks = environ.get("SLURM_NTASKS")
    if world and ntasks and "LOCAL_WORLD_SIZE" not in environ and world != ntasks:
        warnings.append(f"WORLD_SIZE={world} differs from SLURM_NTASKS={ntasks} (srun without torchrun); "
                        "hint: do not set WORLD_SIZE by hand under srun")
    return warnings


def check_threads(environ: Mapping[str, str], available: int, local_ranks: int) -> list[str]:
    """OMP_NUM_THREADS x ranks on this node should not exceed the CPUs this process may use."""
    text = environ.get("OMP_NUM_THREADS")
    if text is None or not text.isdigit():
        return [] if local_ranks == 1 else [
            f"OMP_NUM_THREADS is not set and {local_ranks} ranks share {available} CPUs; hint: "
            f"OMP_NUM_THREADS={max(1, available // local_ranks)} (hpctrain's train.threads does this per rank)"]
    threads = int(text)
    if threads * local_ranks > available:
        return [f"OMP_NUM_THREADS={threads} x {local_ranks} ranks = {threads * local_ranks} threads on {available} "
                f"CPUs: over-subscribed; hint: OMP_NUM_THREADS={max(1, available // local_ranks)}"]
    return []


def check_paths(run_fs: dict[str, Any] | None, data_fs: dict[str, Any] | None, staged: bool) -> list[str]:
    warnings = []
    if data_fs and data_fs["network"] and not staged:
        warnings.append(f"data at {data_fs['path']} is on {data_fs['fstype']} (network file system) and is not "
                        "staged; hint: shards + data.stage_dir (or $SLURM_TMPDIR) copy it to node-local disk once")
    if data_fs and data_fs["fstype"] == "lustre":
        warnings.append(f"Lustre: stripe the shard directory before writing shards, e.g. `lfs setstripe -c 4 -S 4M "
                        f"{data_fs['path']}` (large sequential tar files read faster across several OSTs)")
    for fs in (run_fs, data_fs):
        if fs and fs["free_gib"] < 1:
            warnings.append(f"only {fs['free_gib']} GiB free on {fs['mount']} ({fs['path']})")
    return warnings


def check_network(net: dict[str, Any], cluster_facts: dict[str, Any]) -> list[str]:
    if str(net["address"]).startswith("127.") and cluster_facts.get("num_nodes", 1) > 1:
        return [f"hostname {net['hostname']} resolves to {net['address']} on a multi-node job: other nodes cannot "
                "reach it; hint: fix /etc/hosts or set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME"]
    if str(net["address"]).startswith("unresolvable"):
        return [f"hostname {net['hostname']} does not resolve; the process group cannot bind to it"]
    return []


def report(environ: Mapping[str, str] | None = None, run_dir: Path | None = None, data_dir: Path | None = None,
           staged: bool = False, local_ranks: int | None = None) -> dict[str, Any]:
    """Every fact and warning of this node, as one JSON-ready dict."""
    environ = os.environ if environ is None else environ
    facts = cluster(environ)
    ranks = local_ranks or int(facts.get("local_world_size") or 0) or _slurm_tasks_per_node(environ)
    run_fs = filesystem(run_dir) if run_dir else None
    data_fs = filesystem(data_dir) if data_dir else None
    net = network(environ)
    warnings = ([facts["error"]] if "error" in facts else []) + check_world(environ) + \
        check_threads(environ, cpus(), ranks) + check_paths(run_fs, data_fs, staged or "SLURM_TMPDIR" in environ) + \
        check_network(net, facts)
    return {"node": net["hostname"], "versions": versions(), "gpus": gpus(), "cpus": cpus(), "cluster": facts,
            "slurm": {k: environ[k] for k in SLURM_VARS if k in environ},
            "launch": {k: environ[k] for k in LAUNCH_VARS if k in environ}, "network": net,
            "paths": [fs for fs in (run_fs, data_fs) if fs], "warnings": warnings}


def _slurm_tasks_per_node(environ: Mapping[str, str]) -> int:
    text = environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0].split(",")[0]
    return int(text) if text.isdigit() else 1


def render_text(rep: dict[str, Any]) -> str:
    lines = [f"node        {rep['node']}",
             "versions    " + ", ".join(f"{k} {v}" for k, v in rep["versions"].items()),
             f"cpus        {rep['cpus']} usable by this process",
             "gpus        " + ("; ".join(f"{g['index']}: {g['name']} {g['memory_gib']} GiB" for g in rep["gpus"])
                              or "none (CPU only: gloo)"),
             "cluster     " + ", ".join(f"{k}={v}" for k, v in rep["cluster"].items()),
             "network     " + ", ".join(f"{k}={v}" for k, v in rep["network"].items())]
    lines += [f"slurm       {k}={v}" for k, v in rep["slurm"].items()]
    lines += [f"env         {k}={v}" for k, v in rep["launch"].items()]
    lines += [f"path        {p['path']}: {p['fstype']} at {p['mount']}, {p['free_gib']} GiB free" for p in rep["paths"]]
    lines += [f"WARNING     {w}" for w in rep["warnings"]] or ["no problems found"]
    return "\n".join(lines) + "\n"


def summarise(reports: list[dict[str, Any]]) -> str:
    """One line per node, then what differs between nodes (versions, GPU counts)."""
    lines = [f"{'node':<20} {'gpus':>4} {'cpus':>4} {'torch':<14} {'address':<16} warnings"]
    for rep in sorted(reports, key=lambda r: str(r["node"])):
        lines.append(f"{rep['node']:<20} {len(rep['gpus']):>4} {rep['cpus']:>4} {rep['versions']['torch']:<14} "
                     f"{rep['network']['address']:<16} {len(rep['warnings'])}")
        lines += [f"  - {w}" for w in rep["warnings"]]
    for key in ("torch", "hpctrain", "cuda_build", "nccl"):
        seen = {str(r["versions"].get(key)) for r in reports}
        if len(seen) > 1:
            lines.append(f"MISMATCH: nodes differ in {key}: {sorted(seen)}")
    if len({len(r["gpus"]) for r in reports}) > 1:
        lines.append("MISMATCH: nodes have different GPU counts")
    return "\n".join(lines) + "\n"
