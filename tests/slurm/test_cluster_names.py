"""The test clusters are named per checkout (issue 24, point 6): two checkouts testing on one machine get
their own lab directory (munge socket and lock, configs, state), namespaces, veths, bridge, ports, 2-node
subnet and job ids, all derived from a short hash of the checkout's path (scripts/testcluster/lib.sh).
Cheap: only sources lib.sh; no root, no daemons."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from tests.slurm.cluster import SCRIPTS

NAMES = ("CHECKOUT", "TAG", "LAB", "PORT1", "PORT2", "FIRST_JOB", "NET", "BRIDGE", "NS")


def _names(checkout: Path, **env: str) -> dict[str, str]:
    """What lib.sh of ``checkout`` names, and the cluster config it writes."""
    lib = checkout / "scripts" / "testcluster" / "lib.sh"
    script = f'. {lib}; for n in {" ".join(NAMES)}; do echo "$n=${{!n}}"; done; slurm_conf "$LAB/one" h 127.0.0.1 1 2'
    environ = {k: v for k, v in os.environ.items() if k != "HPCTRAIN_SLURM_LAB"}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={**environ, **env}).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _checkout(root: Path) -> Path:
    (root / "scripts").mkdir(parents=True)
    shutil.copytree(SCRIPTS, root / "scripts" / "testcluster")
    return root


def test_two_checkouts_get_their_own_cluster_names(tmp_path: Path) -> None:
    a, b = _names(_checkout(tmp_path / "a")), _names(_checkout(tmp_path / "b"))
    for checkout, names in ((tmp_path / "a", a), (tmp_path / "b", b)):
        tag = hashlib.sha256(str(checkout.resolve()).encode()).hexdigest()[:6]
        slot = int(tag[:4], 16) % 400
        assert names["TAG"] == tag and names["LAB"] == f"/tmp/hpctrain-slurm-{tag}"
        assert (names["PORT1"], names["PORT2"], names["FIRST_JOB"]) == (str(6800 + 2 * slot), str(7600 + 2 * slot),
                                                                       str(1 + 50 * slot))
        assert names["BRIDGE"] == f"htcbr{tag}" and names["NS"] == f"htc{tag}"
        assert len(names["BRIDGE"]) <= 15 and len(names["NS"] + "v2") <= 15  # Linux interface names
        assert names["ClusterName"] == f"htc{tag}one" and names["FirstJobId"] == names["FIRST_JOB"]
        assert names["AuthInfo"].startswith(f"socket={names['LAB']}/one/munge/")
    for name in ("LAB", "BRIDGE", "NS", "ClusterName"):
        assert a[name] != b[name], name


def test_the_same_checkout_keeps_its_names_and_the_lab_can_be_moved(tmp_path: Path) -> None:
    here = SCRIPTS.parents[1]
    assert _names(here) == _names(here)
    assert _names(here)["CHECKOUT"] == str(here.resolve())
    assert _names(here, HPCTRAIN_SLURM_LAB=str(tmp_path / "lab"))["LAB"] == str(tmp_path / "lab")
