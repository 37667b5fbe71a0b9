"""``hpctrain k8s``: every rendered manifest validates against the operators' published CRD schemas
(tests/launch/k8s_schemas/, made strict about unknown fields) plus the core Pod rules the schemas
leave out; the failure policies do what the contract says (exit 3 retried, at most K times; any
other failure not); user values survive YAML and the kubelet's expansion as written; the option
checks fail before anything is written; the CLI writes, applies through kubectl, or says how.
All in-process: the pods themselves run in tests/launch/test_k8s_pods.py."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.core.errors import EXIT_PREEMPTED, UserError
from hpctrain.core.protocol import write_status
from hpctrain.launch import k8s
from hpctrain.launch.k8s import K8sOptionError, K8sOptions, k8s_job, render
from tests.launch.k8s_util import container_env, crd_schemas, expand, operator_env, pod_templates

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the manifests against the CRD schemas")

WORKDIR = Path("/work/project")  # never created: rendering only resolves paths
ENVIRON = {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "ib0", "HF_TOKEN": "hf_secret_value", "HOME": "/home/u"}
CONFIG = ["data.name=synthetic_tiny", "model.name=mnist_cnn", "run.dir=runs/k8s-golden"]
IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"
CASES = {
    "one-cpu-pod": dict(nodes=1, nproc_per_node=2),
    "gpus": dict(nodes=4, gpus_per_node=8, cpu="64", memory="480Gi", shm_size="64Gi", namespace="team-a",
                 env=("TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "HF_TOKEN")),
}


def _job(kind: str = "pytorchjob", config: tuple[str, ...] = (), environ: dict[str, str] | None = None,
         **options: Any) -> k8s.K8sJob:
    opts = K8sOptions(kind=kind, **{"nodes": 2, "image": IMAGE, "pvc": "shared-runs", **options})  # type: ignore[arg-type]
    return k8s_job(opts, [*CONFIG, *config], environ=ENVIRON if environ is None else environ, workdir=WORKDIR)


def _docs(job: k8s.K8sJob) -> list[dict[str, Any]]:
    """The manifest as kubectl reads it: the YAML text loaded back (equal to what was rendered)."""
    docs = [doc for doc in yaml.safe_load_all(k8s.dump(render(job)))]
    assert docs == render(job)
    return docs


def _pod_problems(pod: dict[str, Any], restart_never: bool) -> list[str]:
    """Core Pod rules the CRDs' embedded PodTemplateSpec schema does not state."""
    spec, problems = pod["spec"], []
    label = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
    volumes = [v["name"] for v in spec["volumes"]]
    if len(set(volumes)) != len(volumes):
        problems.append(f"volume names repeat: {volumes}")
    if restart_never and spec.get("restartPolicy") != "Never":
        problems.append("a Job with podFailurePolicy needs restartPolicy Never")
    for c in spec["containers"]:
        if not label.fullmatch(c["name"]):
            problems.append(f"container name {c['name']!r}")
        mounts = [m["mountPath"] for m in c["volumeMounts"]]
        problems += [f"mount of unknown volume {m['name']}" for m in c["volumeMounts"] if m["name"] not in volumes]
        if len(set(mounts)) != len(mounts) or not all(m.startswith("/") for m in mounts):
            problems.append(f"mount paths {mounts}")
        names = [e["name"] for e in c["env"]]
        if len(set(names)) != len(names) or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names):
            problems.append(f"env names {names}")
        problems += [f"port {p}" for p in c["ports"] if not 1 <= p["containerPort"] <= 65535]
    return problems


@pytest.mark.parametrize("kind", k8s.KINDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_validates_against_the_operators_crd_schemas(kind: str, case: str) -> None:
    config_map, workload = _docs(_job(kind, **CASES[case]))  # type: ignore[arg-type]
    assert config_map["kind"] == "ConfigMap" and set(config_map["data"]) == {"config.yaml"}
    for source, schema in crd_schemas(workload["kind"]):
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(workload), key=str)
        assert not errors, f"{source}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
    for pod in pod_templates(workload):
        assert _pod_problems(pod, restart_never=kind == "jobset") == []
        (container,) = pod["spec"]["containers"]
        assert container["name"] == "pytorch"  # the training operator's default container and port names
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 29500}]


def test_a_misspelt_field_fails_the_strict_schema() -> None:
    """The check can fail: a field the CRD does not know (the API server would drop it silently)."""
    _, workload = _docs(_job("jobset"))
    workload["spec"]["failurePolicy"]["maxRestart"] = 3
    (source, schema), *_ = crd_schemas("JobSet")
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(workload))
    assert any("maxRestart" in e.message for e in errors), source


def test_gpus_resources_volumes_and_nccl_as_the_gpu_operator_and_loaders_need() -> None:
    _, workload = _docs(_job("pytorchjob", **CASES["gpus"]))  # type: ignore[arg-type]
    specs = workload["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 3)  # 4 pods
    assert workload["metadata"]["namespace"] == "team-a" and workload["spec"]["nprocPerNode"] == "8"
    pod = specs["Worker"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"] == {"requests": {"cpu": "64", "memory": "480Gi"},
                              "limits": {"cpu": "64", "memory": "480Gi", "nvidia.com/gpu": 8}}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["run"]["persistentVolumeClaim"] == {"claimName": "shared-runs"}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes["local"]["emptyDir"] == {}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"run": "/mnt/hpctrain", "config": "/etc/hpctrain", "local": "/mnt/local", "shm": "/dev/shm"}
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["NCCL_DEBUG"] == "WARN" and env["NCCL_SOCKET_IFNAME"] == "ib0" and env["OMP_NUM_THREADS"] == "8"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": f"{workload['metadata']['name']}-env", "key": "HF_TOKEN"}}
    assert "hf_secret_value" not in k8s.dump(render(_job("pytorchjob", **CASES["gpus"])))  # type: ignore[arg-type]
    assert pod["terminationGracePeriodSeconds"] == 300 + k8s.EXIT_MARGIN_S
    assert "--shutdown-timeout=300" in c["command"] and "--nproc=8" in c["command"] and "--nnodes=4" in c["command"]


def test_the_configmap_holds_the_validated_config_with_the_pods_paths() -> None:
    job = _job("jobset", config=("optim.lr=0.05", "data.stage_dir=off"))
    config_map, _ = _docs(job)
    pod_cfg = yaml.safe_load(config_map["data"]["config.yaml"])
    assert pod_cfg["run"]["dir"] == "/mnt/hpctrain/runs/k8s-golden"
    assert pod_cfg["data"]["stage_dir"] == "off" and pod_cfg["optim"]["lr"] == 0.05
    staged = yaml.safe_load(_docs(_job("jobset"))[0]["data"]["config.yaml"])
    assert staged["data"]["stage_dir"] == "/mnt/local/stage"  # unset: the pod's node-local emptyDir
    assert load_config(None, [*CONFIG, "optim.lr=0.05", "data.stage_dir=off",
                              "run.dir=/mnt/hpctrain/runs/k8s-golden"]) == _loaded(config_map)
    assert job.local_run_dir == WORKDIR / "runs/k8s-golden"


def _loaded(config_map: dict[str, Any]) -> Any:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(config_map["data"]["config.yaml"])
        f.flush()
        return load_config(f.name, [])


def test_the_rendezvous_comes_from_each_operators_environment() -> None:
    _, pytorchjob = _docs(_job("pytorchjob"))
    (c,) = pod_templates(pytorchjob)[1]["spec"]["containers"]
    env = container_env(c, operator_env(pytorchjob, 1, "job-master-0", 23456), {})
    words = [expand(word, env) for word in c["command"]]
    assert "--rdzv-endpoint=job-master-0:23456" in words and "--nnodes=2" in words and "--nproc=1" in words
    assert env["WORLD_SIZE"] == "2" and env["PET_NPROC_PER_NODE"] == "1"
    _, jobset = _docs(_job("jobset", nodes=3))
    name = jobset["metadata"]["name"]
    (c,) = pod_templates(jobset)[0]["spec"]["containers"]
    # pod k's hostname NAME-node-0-k under the headless service NAME (network.subdomain)
    assert f"--rdzv-endpoint={name}-node-0-0.{name}:29500" in c["command"]
    assert jobset["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": name}
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (3, 3, "Indexed")


# ---------------------------------------------------------------- the preemption contract


def _jobset_outcome(jobset: dict[str, Any], code: int, disrupted: bool = False) -> str:
    """What Kubernetes' Job controller, then the JobSet controller, do with a pod that ended with
    ``code`` (the documented rule semantics: first matching rule wins; no podFailurePolicy rule
    means the failure counts against backoffLimit)."""
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    if code == 0 and not disrupted:
        return "succeeded"
    action = "Count"
    for rule in job["podFailurePolicy"]["rules"]:
        on_code = rule.get("onExitCodes")
        if on_code is not None and (code in on_code["values"]) == (on_code["operator"] == "In"):
            action = rule["action"]
            break
        if disrupted and any(c["type"] == "DisruptionTarget" for c in rule.get("onPodConditions", [])):
            action = rule["action"]
            break
    assert action in ("Count", "FailJob"), action
    reason = "PodFailurePolicy" if action == "FailJob" else \
        "BackoffLimitExceeded" if job["backoffLimit"] == 0 else "retried by the Job"
    for rule in jobset["spec"]["failurePolicy"]["rules"]:
        if not rule.get("onJobFailureReasons") or reason in rule["onJobFailureReasons"]:
            return rule["action"]
    return "RestartJobSet"  # JobSet's default for an unmatched failure


def test_jobset_retries_exit_3_and_a_disruption_and_fails_on_anything_else() -> None:
    _, jobset = _docs(_job("jobset", max_restarts=2))
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 2
    assert _jobset_outcome(jobset, EXIT_PREEMPTED) == "RestartJobSet"
    assert _jobset_outcome(jobset, 137, disrupted=True) == "RestartJobSet"  # SIGKILLed after the grace period
    for failure in (1, 2, 4, 137, 143):
        assert _jobset_outcome(jobset, failure) == "FailJobSet", failure
    assert _jobset_outcome(jobset, 0) == "succeeded"


def test_pytorchjob_retries_exit_3_as_203_at_most_k_times_and_nothing_else(tmp_path: Path) -> None:
    """ExitCode policy: training-operator v1.9.0 recreates a pod only for exit codes >= 128
    (pkg/util/train/train_util.go) and then ignores backoffLimit, so the pods count."""
    _, workload = _docs(_job("pytorchjob", max_restarts=2))
    for spec in workload["spec"]["pytorchReplicaSpecs"].values():
        assert spec["restartPolicy"] == "ExitCode"
        assert {"--preempted-exit=203", "--max-preemptions=2"} <= set(spec["template"]["spec"]["containers"][0]
                                                                       ["command"])
    assert k8s.RETRY_EXIT >= 128 > max(1, 2, EXIT_PREEMPTED, 4)  # hpctrain's failures are never retried
    codes = []
    for event in range(3):  # three preemptions, each seen by both pods on the shared volume
        write_status(tmp_path, "preempted", step=10 * event)
        codes.append([k8s.preempted_exit(tmp_path, k8s.RETRY_EXIT, 2) for _pod in range(2)])
    assert codes == [[203, 203], [203, 203], [EXIT_PREEMPTED, EXIT_PREEMPTED]]
    assert len(json.loads((tmp_path / k8s.PREEMPTIONS_FILE).read_text())["preemptions"]) == 3


def test_hpctrain_run_checks_its_preemption_options_before_launching() -> None:
    assert main(["run", "-n", "1", "--max-preemptions", "2", "train", "data.name=synthetic_tiny"]) == 2
    assert main(["run", "-n", "1", "--preempted-exit", "300", "train", "data.name=synthetic_tiny"]) == 2


# ---------------------------------------------------------------- quoting and refusals


def test_user_values_reach_the_pod_as_written() -> None:
    """No shell in the pod (exec form), YAML from the library, and every $ doubled for the kubelet."""
    tricky = 'a $(MASTER_ADDR) $HOME "q" \'s\' ; `x` $$ \\ end\nline2: {b}'
    plain = "a $(MASTER_ADDR) ${HOME} ; `x` $$ end"  # a config value: the override is read as YAML
    job = _job("pytorchjob", env=(f"MY_FLAG={tricky}",), config=(f"telemetry.experiment={plain}",))
    config_map, workload = _docs(job)
    (c,) = pod_templates(workload)[0]["spec"]["containers"]
    env = container_env(c, operator_env(workload, 0, "job-master-0", 23456), {})
    assert env["MY_FLAG"] == tricky
    assert yaml.safe_load(config_map["data"]["config.yaml"])["telemetry"]["experiment"] == plain
    assert c["command"][:4] == ["python3", "-m", "hpctrain", "run"]  # no sh -c anywhere


@pytest.mark.parametrize(("options", "config", "message"), [
    (dict(image="docker://nvcr.io/nvidia/pytorch:24.05-py3"), (), "drop Apptainer's docker://"),
    (dict(image="nvcr.io#nvidia/pytorch:24.05-py3"), (), "write Pyxis' '#' as '/'"),
    (dict(image="/images/pytorch.sif"), (), "a file cannot be pulled"),
    (dict(image="img:1 --privileged"), (), "not an image reference"),
    (dict(env=("HF_TOKEN=hf_abc",)), (), "looks like a credential ('TOKEN'"),
    (dict(env=("WANDB_API_KEY=x",)), (), "looks like a credential ('KEY'"),
    (dict(env=("MISSING_VAR",)), (), "it is not set here"),
    (dict(env=("MASTER_ADDR=evil",)), (), "the operator, torchrun or hpctrain k8s sets it"),
    (dict(env=("PET_NNODES=9",)), (), "the operator, torchrun or hpctrain k8s sets it"),
    (dict(env=("A-B=1",)), (), "must look like NAME=VALUE"),
    (dict(name="My_Job"), (), "--name 'My_Job' is not a Kubernetes name"),
    (dict(pvc="Bad Claim"), (), "--pvc 'Bad Claim'"),
    (dict(pvc_path="/etc"), (), "--pvc-path '/etc'"),
    (dict(cpu="lots"), (), "--cpu 'lots' is not a Kubernetes quantity"),
    (dict(nproc_per_node=4, cpu="2"), (), "--cpu 2 is less than the 4 processes per pod"),
    (dict(gpus_per_node=4, nproc_per_node=2), (), "one rank per GPU"),
    (dict(nodes=0), (), "--nodes 0 must be >= 1"),
    (dict(max_restarts=-1), (), "--max-restarts -1 must be >= 0"),
    (dict(kind="tfjob"), (), "--kind 'tfjob' is not one of pytorchjob, jobset"),
    ({}, ("run.dir=/scratch/runs/x",), "is not inside --pvc-path /mnt/hpctrain"),
    ({}, ("run.dir=runs/a b",), "holds characters hpctrain or the kubelet would expand"),
    ({}, ("data.batchsize=3",), "unknown key 'data.batchsize'"),
])
def test_bad_options_fail_before_anything_is_written(options: dict[str, Any], config: tuple[str, ...],
                                                     message: str) -> None:
    with pytest.raises(UserError) as err:
        _job(**options, config=config)  # type: ignore[arg-type]
    assert message in str(err.value)
    assert getattr(err.value, "exit_code", None) == 2, type(err.value)


def test_a_credential_is_refused_even_as_a_path_of_this_machine() -> None:
    with pytest.raises(K8sOptionError, match="credential"):
        _job(env=("AWS_SESSION_TOKEN=/etc/hosts",))  # unlike Slurm's shared file system, the pods do not see it


# ---------------------------------------------------------------- the command line


def _fake_kubectl(tmp_path: Path, code: int = 0) -> Path:
    """A kubectl that records its arguments and stdin, and exits CODE."""
    path = tmp_path / "kubectl"
    path.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\ncat >> {tmp_path}/stdin\n'
                    f'echo "kubectl says $1"; [ {code} = 0 ] || echo "error: no cluster" >&2; exit {code}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _cli(tmp_path: Path, *extra: str) -> list[str]:
    return ["k8s", *CONFIG[:2], "run.dir=runs/job", "--nodes", "2", "--image", IMAGE, "--pvc", "shared", *extra]


def test_cli_dry_run_prints_the_manifest_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    assert main([*_cli(tmp_path, "--kind", "jobset", "--env", "HF_TOKEN"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "JobSet"]
    assert "hf_secret_value" not in out and "kubectl create secret generic hpctrain-job-env" in out
    assert not (tmp_path / "runs").exists()


def test_cli_without_kubectl_writes_the_manifest_and_says_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(k8s, "find_kubectl", lambda: None)
    assert main(_cli(tmp_path)) == 0
    path = tmp_path / "runs" / "job" / k8s.MANIFEST_NAME
    assert f"apply it with kubectl apply -f {path}" in capsys.readouterr().out
    assert [d["kind"] for d in yaml.safe_load_all(path.read_text())] == ["ConfigMap", "PyTorchJob"]


def test_cli_applies_the_secret_from_stdin_then_the_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    monkeypatch.setattr(k8s, "find_kubectl", lambda: str(_fake_kubectl(tmp_path)))
    assert main(_cli(tmp_path, "--env", "HF_TOKEN")) == 0
    path = tmp_path / "runs" / "job" / k8s.MANIFEST_NAME
    assert (tmp_path / "calls").read_text().splitlines() == ["apply -f -", f"apply -f {path}"]
    secret = yaml.safe_load((tmp_path / "stdin").read_text())
    assert secret["kind"] == "Secret" and secret["stringData"] == {"HF_TOKEN": "hf_secret_value"}
    assert not any("hf_secret_value" in p.read_text() for p in (tmp_path / "runs").rglob("*") if p.is_file())
    assert "kubectl says apply" in capsys.readouterr().out


def test_cli_a_failing_kubectl_is_exit_1_and_the_manifest_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(k8s, "find_kubectl", lambda: str(_fake_kubectl(tmp_path, code=1)))
    assert main(_cli(tmp_path)) == 1
    err = capsys.readouterr().err
    path = tmp_path / "runs" / "job" / k8s.MANIFEST_NAME
    assert "failed (exit 1): error: no cluster; the manifest stays at" in err and path.is_file()
    assert main(["k8s", "--nodes", "2"]) == 2 and "needs --image, --pvc" in capsys.readouterr().err
