"""The pods of ``hpctrain k8s``'s default PyTorchJob, run here: each pod's command from the rendered
manifest, with the environment the training operator would give it (pytorch/envvar.go of v1.9.0:
MASTER_ADDR = pod 0, here 127.0.0.1) and its volumes as local folders, as two local process
groups. SIGTERM to one pod's first process (what the kubelet sends on preemption) ends both pods
with 203, the code the operator retries; the recreated pods resume bit-identical to an
uninterrupted run on forked ranks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hpctrain.launch import k8s
from tests.ckpt_models import SLOW_RUN_ARGS
from tests.dist_utils import finish_launch, free_port, launch_env, train_cases
from tests.launch.k8s_util import container_env, expand, operator_env, pod_templates

pytestmark = pytest.mark.slow  # two launchers, a resume: scheduled first (tests/conftest.py)
TIMEOUT = 180
ARGS = [*SLOW_RUN_ARGS, "train.epochs=1", "data.synthetic_size=512"]  # 16 steps of ~20 ms at world size 2


def _pods(tmp_path: Path) -> tuple[list[list[str]], list[dict[str, str]], Path]:
    """Each pod's command and environment, as the operator and the kubelet would make them."""
    opts = k8s.K8sOptions(nodes=2, image="registry.example.com/hpctrain:1", pvc="runs", pvc_path=str(tmp_path / "pvc"),
                          python=sys.executable, grace_s=60, max_restarts=1)
    job = k8s.k8s_job(opts, [*ARGS, "run.dir=run"], environ={}, workdir=tmp_path / "here")
    config_map, workload = k8s.render(job)
    config = tmp_path / "configmap" / k8s.CONFIG_FILE  # the ConfigMap volume
    config.parent.mkdir()
    config.write_text(config_map["data"][k8s.CONFIG_FILE])
    port, commands, envs = free_port(), [], []
    for index, template in enumerate(pod_templates(workload)):
        (container,) = template["spec"]["containers"]
        env = container_env(container, operator_env(workload, index, "127.0.0.1", port), {})
        words = [expand(word, env) for word in container["command"]]
        commands.append([str(config) if w == f"{k8s.CONFIG_DIR}/{k8s.CONFIG_FILE}" else w for w in words])
        envs.append(launch_env(**env))
    return commands, envs, Path(str(job.pod_run_dir))


def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _steps(run_dir: Path) -> int:
    try:
        return max((json.loads(line).get("step", 0) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                    if line.endswith("}")), default=0)
    except FileNotFoundError:
        return 0


def test_two_pods_preempted_exit_203_then_resume_bit_identical(tmp_path: Path) -> None:
    commands, envs, run_dir = _pods(tmp_path)
    pods = [_start(c, e) for c, e in zip(commands, envs)]
    deadline = time.monotonic() + TIMEOUT
    while _steps(run_dir) < 3 and time.monotonic() < deadline and all(p.poll() is None for p in pods):
        time.sleep(0.02)
    assert _steps(run_dir) >= 3, [finish_launch(p, 5)[1][-3000:] for p in pods]
    pods[1].send_signal(signal.SIGTERM)  # the kubelet: SIGTERM to the worker pod's first process
    results = [finish_launch(p, TIMEOUT) for p in pods]
    assert [code for code, _ in results] == [k8s.RETRY_EXIT] * 2, [out[-3000:] for _, out in results]
    assert json.loads((run_dir / "status.json").read_text())["outcome"] == "preempted"
    assert len(json.loads((run_dir / k8s.PREEMPTIONS_FILE).read_text())["preemptions"]) == 1
    assert not (run_dir / "summary.json").exists()

    # the operator recreates both pods with the same command; resume=auto continues
    results = [finish_launch(p, TIMEOUT) for p in [_start(c, e) for c, e in zip(commands, envs)]]
    assert [code for code, _ in results] == [0, 0], [out[-3000:] for _, out in results]
    resumed = json.loads((run_dir / "summary.json").read_text())
    reference = train_cases(2, [("ref", [*ARGS, "checkpoint.enabled=false"])], tmp_path / "ref",
                            keep=("params_sha256", "steps"))[0]["ref"]
    assert isinstance(reference, dict), reference
    assert (resumed["steps"], resumed["params_sha256"]) == (reference["steps"], reference["params_sha256"])
    config = Path(commands[0][commands[0].index("train") + 1])
    assert yaml.safe_load(config.read_text())["run"]["dir"] == str(run_dir)  # the pods' run dir: on the claim
