"""``hpctrain doctor`` (issue 9, section 3): it runs, ``--json`` parses, and each check flags its mistake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.launch import doctor


def test_doctor_runs_and_json_parses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "data.name=synthetic_tiny", f"run.dir={tmp_path / 'run'}", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["versions"]["torch"] and rep["cpus"] >= 1 and rep["cluster"]["source"] == "single"
    assert rep["paths"][0]["path"] == str(tmp_path / "run") and rep["paths"][0]["fstype"] != "unknown"
    assert isinstance(rep["warnings"], list) and rep["network"]["hostname"]
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("node ") and "versions    python" in text


def test_world_size_mismatch_is_flagged() -> None:
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "SLURM_NNODES": "3"}
    (warning,) = doctor.check_world(env)
    assert "WORLD_SIZE=8 but SLURM_NNODES=3 x LOCAL_WORLD_SIZE=4 = 12" in warning
    assert doctor.check_world({"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "4", "SLURM_NNODES": "3"}) == []


def test_thread_oversubscription_is_flagged() -> None:
    (warning,) = doctor.check_threads({"OMP_NUM_THREADS": "8"}, available=16, local_ranks=4)
    assert "OMP_NUM_THREADS=8 x 4 ranks = 32 threads on 16 CPUs" in warning and "OMP_NUM_THREADS=4" in warning
    assert doctor.check_threads({"OMP_NUM_THREADS": "4"}, available=16, local_ranks=4) == []
    assert "is not set" in doctor.check_threads({}, available=16, local_ranks=4)[0]


def test_network_file_system_without_staging_and_lustre_advice() -> None:
    lustre = {"path": "/lus/data", "fstype": "lustre", "mount": "/lus", "free_gib": 900.0, "network": True}
    warnings = doctor.check_paths(None, lustre, staged=False)
    assert any("not staged" in w for w in warnings) and any("lfs setstripe" in w for w in warnings)
    assert not any("not staged" in w for w in doctor.check_paths(None, lustre, staged=True))


def test_filesystem_of_a_path_that_does_not_exist_yet(tmp_path: Path) -> None:
    fs = doctor.filesystem(tmp_path / "a" / "b")
    assert fs["exists"] is False and fs["free_gib"] >= 0 and fs["mount"].startswith("/")


def test_loopback_hostname_on_a_multinode_job_is_flagged() -> None:
    net = {"hostname": "n1", "address": "127.0.1.1", "interface": "lo"}
    assert "other nodes cannot reach it" in doctor.check_network(net, {"num_nodes": 2})[0]
    assert doctor.check_network(net, {"num_nodes": 1}) == []


def test_summary_per_node_shows_mismatches() -> None:
    base = {"gpus": [], "cpus": 2, "network": {"address": "10.0.0.1"}, "warnings": []}
    reports = [{**base, "node": "n1", "versions": {"torch": "2.13.0"}},
               {**base, "node": "n2", "versions": {"torch": "2.12.0"}, "warnings": ["x"]}]
    text = doctor.summarise(reports)
    assert text.splitlines()[1].startswith("n1") and "  - x" in text and "nodes differ in torch" in text


def test_all_nodes_needs_an_allocation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--all-nodes"]) == 2
    assert "inside an allocation" in capsys.readouterr().err
