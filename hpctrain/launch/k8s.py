"""``hpctrain k8s``: the job of ``hpctrain slurm`` as one Kubernetes manifest, for the Kubeflow
training operator (``PyTorchJob``, kubeflow.org/v1, the default) or for JobSet
(jobset.x-k8s.io/v1alpha2). docs/cluster.md, Kubernetes, says why PyTorchJob is the default.

One pod per node, each running ``hpctrain run --nnodes N --nproc G`` in exec form (no shell, so
no user value is ever read as shell code); the validated config travels in a ConfigMap. The
preemption contract, as on Slurm:

1. Kubernetes preempts a pod (scheduler preemption, eviction, node drain) with SIGTERM to its
   first process, ``hpctrain run``, and SIGKILL after ``terminationGracePeriodSeconds``;
2. the launcher hands SIGTERM to its ranks (in the default ``checkpoint.signals``); every rank of
   every pod agrees at the next step, they save one committed checkpoint and exit 3;
3. exit 3 is retried, a failure is not, at most ``--max-restarts`` times:

   * JobSet: the Job's ``podFailurePolicy`` fails it at once (reason ``PodFailurePolicy``) on any
     exit code but 3; exit 3 (and a pod Kubernetes disrupted) only counts against
     ``backoffLimit: 0`` (reason ``BackoffLimitExceeded``); the JobSet's ``failurePolicy`` rules
     restart the whole JobSet on the latter, ``maxRestarts`` times, and fail it on the rest;
   * PyTorchJob: ``restartPolicy: ExitCode`` recreates a pod only for exit codes >= 128
     (``IsRetryableExitCode`` of training-operator v1.9.0) and ignores ``backoffLimit`` then
     (kubeflow/training-operator#2045), so ``hpctrain run --preempted-exit 203`` turns the
     ranks' exit 3 into 203 while this run was preempted at most ``--max-restarts`` times
     (counted in the run directory, :func:`preempted_exit`), and into 3 (not retried) after;
4. the recreated pods start the same command; resume=auto continues from the checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml

from hpctrain.config import check_world, load_config, split_config_args
from hpctrain.core.atomic import atomic_write_text, write_json
from hpctrain.core.errors import EXIT_PREEMPTED, RunError, UserError, io_error
from hpctrain.core.protocol import SIGNALS_ENV, read_status
from hpctrain.core.rundir import claim_run_dir, resolve_run_dir
from hpctrain.core.section import to_dict
from hpctrain.launch.container import is_image_path
from hpctrain.launch.program import user_program
from hpctrain.launch.slurm import (
    _ENV_NAME,
    DEFAULT_SIGNAL_LEAD_S,
    PASS_THROUGH,
    SIGNAL_MARGIN_S,
    credential_word,
    measured_save_s,
    measured_validation_s,
    rank_signals,
)

Kind = Literal["pytorchjob", "jobset"]
KINDS: tuple[Kind, ...] = ("pytorchjob", "jobset")
DEFAULT_KIND: Kind = "pytorchjob"
MANIFEST_NAME = "hpctrain-k8s.yaml"
PREEMPTIONS_FILE = "k8s-preemptions.json"
# The training operator finds its container, and the port it gives MASTER_PORT, by these names.
CONTAINER = "pytorch"
PORT_NAME = "pytorchjob-port"
DEFAULT_PORT = 29500
# >= 128: what training-operator's ExitCode policy retries; not 128 + a signal (up to 192), so a
# pod's log tells hpctrain's retry apart from a death by a signal.
RETRY_EXIT = 203
EXIT_MARGIN_S = 30         # after the ranks' shutdown timeout: the launcher reports and exits
CONFIG_DIR = "/etc/hpctrain"  # the ConfigMap, read-only
CONFIG_FILE = "config.yaml"
LOCAL_DIR = "/mnt/local"   # the node-local emptyDir: data.stage_dir
DEFAULT_PVC_PATH = "/mnt/hpctrain"
JOBSET_JOB = "node"        # the JobSet's one replicated Job: pod k is NAME-node-0-k.NAME
# A name that becomes pods' and services' names (NAME-worker-12, NAME-node-0-12): an RFC 1035
# label with room for those suffixes within 63 characters.
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# Paths inside the pod: hpctrain expands $VAR, ~ and {key} in run.dir, kubelet $(VAR) in args.
_POD_PATH = re.compile(r"/[A-Za-z0-9_./+@=,-]*")
_QUANTITY = re.compile(r"\d+(\.\d+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?")
_CPU = re.compile(r"\d+(\.\d+)?m?")
# An OCI image reference: [registry[:port]/]path[:tag][@digest], no blanks, quotes or control characters.
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*(@sha256:[0-9a-f]{64})?")
# Set by the operator (PyTorchJob: MASTER_*, WORLD_SIZE, RANK, PET_*; JobSet and Job:
# JOB_COMPLETION_INDEX), by torchrun for the ranks, or by hpctrain k8s itself.
RESERVED_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                          "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "JOB_COMPLETION_INDEX",
                          "PYTHONUNBUFFERED", SIGNALS_ENV})
RESERVED_PREFIXES = ("PET_", "TORCHELASTIC_", "JOBSET_")


class K8sOptionError(UserError):
    """An ``hpctrain k8s`` option is malformed or contradicts another; the message names it."""


@dataclass(frozen=True, kw_only=True)
class K8sOptions:
    nodes: int
    image: str
    pvc: str
    kind: Kind = DEFAULT_KIND
    gpus_per_node: int = 0
    nproc_per_node: int | None = None
    cpu: str | None = None
    memory: str | None = None
    shm_size: str | None = None
    pvc_path: str = DEFAULT_PVC_PATH
    name: str | None = None
    namespace: str | None = None
    max_restarts: int = 3
    grace_s: int | None = None
    port: int = DEFAULT_PORT
    python: str = "python3"
    env: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class K8sJob:
    """Everything the manifest needs, after validation."""

    opts: K8sOptions
    name: str
    nproc: int
    grace_s: int
    pod_run_dir: PurePosixPath  # on the claim, as the pods see it
    local_run_dir: Path         # where the manifest is written here
    config: dict[str, Any]      # the ConfigMap's config.yaml
    extra_args: tuple[str, ...]  # overrides after the config file (checkpoint.signals)
    exports: dict[str, str] = field(default_factory=dict)
    passed: tuple[str, ...] = ()  # --env NAME: from the Secret NAME-env

    @property
    def secret_name(self) -> str:
        return f"{self.name}-env"


# ---------------------------------------------------------------- validation


def k8s_job(opts: K8sOptions, config_args: list[str], environ: Mapping[str, str] | None = None,
            workdir: Path | None = None) -> K8sJob:
    """Validate options and config together; nothing is written before this returns."""
    environ = os.environ if environ is None else environ
    workdir = (workdir or Path.cwd()).resolve()
    _check_counts(opts)
    _check_words(opts)
    _check_env(opts, environ)
    nproc = _procs(opts)
    if user_program(config_args, base=workdir) is not None:
        raise K8sOptionError("hpctrain k8s runs hpctrain train (a config and key=value overrides), not a script of "
                             "your own; hint: build the script into the image and use hpctrain slurm's form, or "
                             "docs/cluster.md, Kubernetes")
    path, overrides = split_config_args(config_args)
    cfg = load_config(path, overrides)
    check_world(cfg, opts.nodes * nproc)
    pod_run_dir = _pod_run_dir(resolve_run_dir(cfg.run.dir, cfg), opts.pvc_path)
    local_run_dir = workdir / pod_run_dir.relative_to(opts.pvc_path)
    config = to_dict(cfg)
    config["run"]["dir"] = str(pod_run_dir)
    if config["data"].get("stage_dir") is None:  # unset: stage on the pod's node-local emptyDir
        config["data"]["stage_dir"] = f"{LOCAL_DIR}/stage"
    name = opts.name or _default_name(local_run_dir.name)
    _check_name("--name", name, _NAME, "lower-case letters, digits and '-', starting with a letter, at most 40")
    return K8sJob(opts=opts, name=name, nproc=nproc, grace_s=_grace(opts, local_run_dir), pod_run_dir=pod_run_dir,
                  local_run_dir=local_run_dir, config=config, extra_args=rank_signals("TERM", cfg.checkpoint),
                  exports=_exports(opts, environ), passed=_passed(opts))


def _check_counts(opts: K8sOptions) -> None:
    if opts.kind not in KINDS:
        raise K8sOptionError(f"--kind {opts.kind!r} is not one of {', '.join(KINDS)}")
    for option, value, low in (("--nodes", opts.nodes, 1), ("--gpus-per-node", opts.gpus_per_node, 0),
                               ("--max-restarts", opts.max_restarts, 0)):
        if value < low:
            raise K8sOptionError(f"{option} {value} must be >= {low}")
    if not 1024 <= opts.port <= 65535:
        raise K8sOptionError(f"--port {opts.port} must be within 1024..65535")
    if opts.grace_s is not None and not 1 <= opts.grace_s <= 86400:
        raise K8sOptionError(f"--grace {opts.grace_s} s must be within 1..86400")


def _check_words(opts: K8sOptions) -> None:
    _check_image(opts.image)
    _check_name("--pvc", opts.pvc, _NAMESPACE, "a claim name: lower-case letters, digits and '-'")
    if opts.namespace is not None:
        _check_name("--namespace", opts.namespace, _NAMESPACE, "lower-case letters, digits and '-'")
    if not _POD_PATH.fullmatch(opts.pvc_path) or opts.pvc_path.rstrip("/") in ("", "/etc", CONFIG_DIR, LOCAL_DIR,
                                                                                "/dev", "/dev/shm", "/proc", "/sys"):
        raise K8sOptionError(f"--pvc-path {opts.pvc_path!r} must be an absolute path of letters, digits and _./+@=,- "
                             "that no other volume of the pod uses; hint: the default, " + DEFAULT_PVC_PATH)
    for option, value, pattern in (("--cpu", opts.cpu, _CPU), ("--memory", opts.memory, _QUANTITY),
                                   ("--shm-size", opts.shm_size, _QUANTITY)):
        if value is not None and not pattern.fullmatch(value):
            raise K8sOptionError(f"{option} {value!r} is not a Kubernetes quantity; hint: e.g. --cpu 32 (or 500m), "
                                 "--memory 200Gi, --shm-size 16Gi")
    if not _POD_PATH.fullmatch(opts.python) and not re.fullmatch(r"[A-Za-z0-9_.+-]+", opts.python):
        raise K8sOptionError(f"--python {opts.python!r} must be a command name or an absolute path inside the image")


def _check_image(image: str) -> None:
    """An image the kubelet pulls: a registry reference, never a file (.sif, .sqsh) or a runtime's own syntax."""
    hint = ""
    if image.startswith("docker://"):
        hint = f"drop Apptainer's docker:// (--image {image.removeprefix('docker://')})"
    elif "#" in image:
        hint = f"write Pyxis' '#' as '/' (--image {image.replace('#', '/', 1)})"
    elif is_image_path(image, "pyxis") or image.endswith(".sif"):
        hint = "a file cannot be pulled: push the image to a registry the cluster reaches, and give its reference"
    elif not _IMAGE.fullmatch(image):
        hint = "a registry reference such as nvcr.io/nvidia/pytorch:24.05-py3 (no blanks or quotes)"
    if hint:
        raise K8sOptionError(f"--image {image!r} is not an image reference the kubelet can pull; hint: {hint}")


def _check_name(option: str, value: str, pattern: re.Pattern[str], what: str) -> None:
    if not pattern.fullmatch(value):
        raise K8sOptionError(f"{option} {value!r} is not a Kubernetes name ({what}); hint: e.g. {option} my-job")


def _check_env(opts: K8sOptions, environ: Mapping[str, str]) -> None:
    """``--env NAME=VALUE`` goes into the manifest; ``--env NAME`` into the Secret NAME-env, created
    from this environment when the manifest is applied: no file holds its value."""
    for item in opts.env:
        name, has_value, _ = item.partition("=")
        if not _ENV_NAME.fullmatch(name):
            raise K8sOptionError(f"--env {item!r} must look like NAME=VALUE or NAME (letters, digits, _)")
        if name in RESERVED_ENV or name.startswith(RESERVED_PREFIXES):
            raise K8sOptionError(f"--env {name}=... is refused: the operator, torchrun or hpctrain k8s sets it for "
                                 "the pods (the rendezvous depends on it); hint: pick another name")
        if not has_value and name not in environ:
            raise K8sOptionError(f"--env {name} passes {name} from this environment to the pods (through the Secret "
                                 f"the manifest names), but it is not set here; hint: export {name} first")
        word = credential_word(name)
        if has_value and word:
            raise K8sOptionError(
                f"--env {name}=... looks like a credential ({word!r} in its name): its value would be written into "
                f"the manifest ({MANIFEST_NAME} in the run directory, --dry-run's output, and the job object anyone "
                f"who may read jobs of the namespace reads); hint: export {name} here and pass --env {name}: "
                "hpctrain k8s puts it into a Secret (kubectl apply from its stdin, no file)")


def _procs(opts: K8sOptions) -> int:
    if opts.gpus_per_node and opts.nproc_per_node is not None and opts.nproc_per_node != opts.gpus_per_node:
        raise K8sOptionError(f"--nproc-per-node {opts.nproc_per_node} differs from --gpus-per-node "
                             f"{opts.gpus_per_node}: one rank per GPU; hint: leave --nproc-per-node out on GPU nodes")
    nproc = opts.gpus_per_node or opts.nproc_per_node or 1
    if nproc < 1:
        raise K8sOptionError(f"--nproc-per-node {nproc} must be >= 1")
    if opts.cpu is not None and _cpus(opts.cpu) < nproc:
        raise K8sOptionError(f"--cpu {opts.cpu} is less than the {nproc} processes per pod; hint: at least one "
                             "CPU per rank")
    return nproc


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _pod_run_dir(run_dir: Path, pvc_path: str) -> PurePosixPath:
    """run.dir as the pods see it: a relative one under the claim's mount, an absolute one inside it."""
    mount = PurePosixPath(pvc_path)
    path = PurePosixPath(os.path.normpath(mount / run_dir.as_posix()))
    if path == mount or mount not in path.parents:
        raise K8sOptionError(f"run.dir {str(run_dir)!r} is not inside --pvc-path {pvc_path}, the shared volume every "
                             "pod sees; hint: a relative run.dir (it goes under the volume), e.g. run.dir=runs/job1")
    if not _POD_PATH.fullmatch(str(path)):
        raise K8sOptionError(f"run.dir {str(path)!r} holds characters hpctrain or the kubelet would expand in the "
                             "pod ($, ~, {, blanks, quotes); hint: letters, digits and _./+@=,- only")
    return path


def _default_name(run_name: str) -> str:
    """hpctrain-<run dir name>, as a Kubernetes name (lower case, '-' for anything else, cut to fit)."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")
    return f"hpctrain-{slug}"[:40].rstrip("-") if slug else "hpctrain"


def _grace(opts: K8sOptions, local_run_dir: Path) -> int:
    """Seconds the ranks get to save after SIGTERM: given, or as hpctrain slurm's warning lead
    (2 x a measured save + the longest validation + margin, else 300)."""
    if opts.grace_s is not None:
        return opts.grace_s
    measured = measured_save_s(local_run_dir)
    if measured is None:
        return DEFAULT_SIGNAL_LEAD_S
    return math.ceil(2 * measured + measured_validation_s(local_run_dir)) + SIGNAL_MARGIN_S


def _exports(opts: K8sOptions, environ: Mapping[str, str]) -> dict[str, str]:
    """NCCL_*/GLOO_*/TORCH_NCCL_* of this shell, OMP_NUM_THREADS from --cpu, then --env NAME=VALUE."""
    exports = {k: v for k, v in sorted(environ.items()) if k.startswith(PASS_THROUGH)}
    if opts.cpu is not None:
        exports["OMP_NUM_THREADS"] = str(max(1, int(_cpus(opts.cpu)) // _procs(opts)))
    exports.update(item.split("=", 1) for item in opts.env if "=" in item)  # type: ignore[misc]
    for name in _passed(opts):
        exports.pop(name, None)
    return exports


def _passed(opts: K8sOptions) -> tuple[str, ...]:
    return tuple(dict.fromkeys(item for item in opts.env if "=" not in item))


# ---------------------------------------------------------------- rendering


def escape(value: str) -> str:
    """A literal for a container's command or env value: the kubelet expands ``$(NAME)`` there and
    reads ``$$`` as ``$``, so every ``$`` of a user's value is doubled."""
    return value.replace("$", "$$")


def render(job: K8sJob) -> list[dict[str, Any]]:
    """The manifest's objects: the ConfigMap with the config, then the PyTorchJob or JobSet."""
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(job, f"{job.name}-config"),
                  "data": {CONFIG_FILE: yaml.safe_dump(job.config, sort_keys=False)}}
    workload = _pytorchjob(job) if job.opts.kind == "pytorchjob" else _jobset(job)
    return [config_map, workload]


class _Dumper(yaml.SafeDumper):
    """The safe dumper, with multi-line strings (the ConfigMap's config.yaml) as readable ``|`` blocks;
    PyYAML falls back to a quoted scalar wherever a block could not hold the text exactly."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def dump(docs: list[dict[str, Any]]) -> str:
    """YAML through the library's safe dumper: every user value is a scalar quoted where it needs it."""
    header = "# Written by `hpctrain k8s`; apply with `kubectl apply -f THIS_FILE` (docs/cluster.md, Kubernetes)\n"
    return header + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def _metadata(job: K8sJob, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": _labels(job)}
    if job.opts.namespace:
        meta["namespace"] = job.opts.namespace
    return meta


def _labels(job: K8sJob) -> dict[str, str]:
    return {"app.kubernetes.io/name": "hpctrain", "app.kubernetes.io/instance": job.name}


def command(job: K8sJob) -> list[str]:
    """Each pod's command: ``hpctrain run`` on the operator's rendezvous, then train on the ConfigMap."""
    o = job.opts
    if o.kind == "pytorchjob":  # the operator's variables, expanded by the kubelet
        endpoint = "$(MASTER_ADDR):$(MASTER_PORT)"
        retry = [f"--preempted-exit={RETRY_EXIT}", f"--max-preemptions={o.max_restarts}"]
    else:  # pod 0's stable name under the JobSet's headless service
        endpoint, retry = f"{job.name}-{JOBSET_JOB}-0-0.{job.name}:{o.port}", []
    return [o.python, "-m", "hpctrain", "run", f"--nnodes={o.nodes}", f"--nproc={job.nproc}",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job.name}", f"--shutdown-timeout={job.grace_s}", *retry,
            "train", f"{CONFIG_DIR}/{CONFIG_FILE}", *map(escape, job.extra_args)]


def _env(job: K8sJob) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": escape(v)} for k, v in job.exports.items()]
    env += [{"name": name, "valueFrom": {"secretKeyRef": {"name": job.secret_name, "key": name}}}
            for name in job.passed]
    return env


def _resources(job: K8sJob) -> dict[str, Any]:
    o = job.opts
    amounts = {k: v for k, v in (("cpu", o.cpu), ("memory", o.memory)) if v is not None}
    limits: dict[str, Any] = dict(amounts)
    if o.gpus_per_node:
        limits["nvidia.com/gpu"] = o.gpus_per_node  # the GPU Operator's device plugin; requests follow limits
    resources: dict[str, Any] = {}
    if amounts:
        resources["requests"] = amounts
    if limits:
        resources["limits"] = limits
    return resources


def _container(job: K8sJob) -> dict[str, Any]:
    mounts = [{"name": "run", "mountPath": job.opts.pvc_path},
              {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "local", "mountPath": LOCAL_DIR},
              {"name": "shm", "mountPath": "/dev/shm"}]  # loader workers' tensors; the runtime's default is 64 MiB
    container: dict[str, Any] = {"name": CONTAINER, "image": job.opts.image, "command": command(job),
                                 "env": _env(job), "volumeMounts": mounts,
                                 "ports": [{"name": PORT_NAME, "containerPort": job.opts.port}]}
    resources = _resources(job)
    if resources:
        container["resources"] = resources
    return container


def _pod_spec(job: K8sJob, restart_never: bool) -> dict[str, Any]:
    shm: dict[str, Any] = {"medium": "Memory"}
    if job.opts.shm_size:
        shm["sizeLimit"] = job.opts.shm_size
    spec: dict[str, Any] = {
        # SIGTERM, then this long before SIGKILL: the ranks' save (--shutdown-timeout) and the launcher's exit
        "terminationGracePeriodSeconds": job.grace_s + EXIT_MARGIN_S,
        "containers": [_container(job)],
        "volumes": [{"name": "run", "persistentVolumeClaim": {"claimName": job.opts.pvc}},
                    {"name": "config", "configMap": {"name": f"{job.name}-config"}},
                    {"name": "local", "emptyDir": {}},
                    {"name": "shm", "emptyDir": shm}]}
    if restart_never:
        spec["restartPolicy"] = "Never"  # podFailurePolicy needs it; the Job (not the kubelet) decides
    if job.opts.gpus_per_node:  # GPU nodes are often tainted so that only GPU pods land there
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return spec


def _template(job: K8sJob, restart_never: bool) -> dict[str, Any]:
    return {"metadata": {"labels": _labels(job)}, "spec": _pod_spec(job, restart_never)}


def _pytorchjob(job: K8sJob) -> dict[str, Any]:
    o = job.opts

    def replicas(count: int) -> dict[str, Any]:
        # ExitCode: a pod that exits >= 128 is recreated, any other failure fails the job
        return {"replicas": count, "restartPolicy": "ExitCode", "template": _template(job, restart_never=False)}

    specs = {"Master": replicas(1)}
    if o.nodes > 1:
        specs["Worker"] = replicas(o.nodes - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(job, job.name),
            "spec": {"nprocPerNode": str(job.nproc),
                     # bounds OnFailure restarts only: ExitCode recreates pods, hpctrain run counts them
                     "runPolicy": {"backoffLimit": o.max_restarts, "cleanPodPolicy": "None"},
                     "pytorchReplicaSpecs": specs}}


def _jobset(job: K8sJob) -> dict[str, Any]:
    o = job.opts
    pod_failures = [
        # preempted, evicted, drained by Kubernetes: a restart, whatever the exit code
        {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        # any exit but 3 (a crash, bad config, a hang): the Job fails with reason PodFailurePolicy
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn",
                                              "values": [EXIT_PREEMPTED]}},
    ]  # exit 3 matches no rule: it counts against backoffLimit 0, reason BackoffLimitExceeded
    template = {"spec": {"parallelism": o.nodes, "completions": o.nodes, "completionMode": "Indexed",
                         "backoffLimit": 0, "podFailurePolicy": {"rules": pod_failures},
                         "template": _template(job, restart_never=True)}}
    rules = [{"name": "failed", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
             {"name": "preempted", "action": "RestartJobSet", "onJobFailureReasons": ["BackoffLimitExceeded"]},
             {"name": "otherwise", "action": "FailJobSet"}]  # without it, an unmatched failure restarts
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _metadata(job, job.name),
            "spec": {"network": {"enableDNSHostnames": True, "subdomain": job.name},
                     "failurePolicy": {"maxRestarts": o.max_restarts, "rules": rules},
                     "replicatedJobs": [{"name": JOBSET_JOB, "replicas": 1, "template": template}]}}


def secret(job: K8sJob, environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The Secret of the --env NAME values, from this environment: applied through kubectl's stdin only."""
    if not job.passed:
        return None
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _metadata(job, job.secret_name),
            "stringData": {name: environ[name] for name in job.passed}}


def secret_hint(job: K8sJob) -> str:
    literals = " ".join(f'--from-literal={name}="${name}"' for name in job.passed)
    namespace = f" -n {job.opts.namespace}" if job.opts.namespace else ""
    return f"kubectl create secret generic {job.secret_name}{namespace} {literals}"


# ---------------------------------------------------------------- writing and applying


def write_manifest(job: K8sJob, text: str) -> Path:
    job.local_run_dir.mkdir(parents=True, exist_ok=True)
    claim_run_dir(job.local_run_dir)
    path = job.local_run_dir / MANIFEST_NAME
    try:
        atomic_write_text(path, text)
    except OSError as err:
        raise io_error("write the manifest", path, err) from err
    return path


def apply(job: K8sJob, path: Path, environ: Mapping[str, str], kubectl: str) -> list[str]:
    """``kubectl apply``: the Secret (if any) from stdin, then the manifest; kubectl's own lines."""
    lines: list[str] = []
    found = secret(job, environ)
    if found is not None:
        lines += _kubectl([kubectl, "apply", "-f", "-"], yaml.safe_dump(found), path)
    return lines + _kubectl([kubectl, "apply", "-f", str(path)], None, path)


def _kubectl(cmd: list[str], stdin: str | None, manifest: Path) -> list[str]:
    try:
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as err:
        raise RunError(f"`{' '.join(cmd)}` did not run ({err}); the manifest stays at {manifest}") from err
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise RunError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {last}; the manifest stays at {manifest}; "
                       "hint: kubectl config current-context, or apply it from a machine with cluster access")
    return proc.stdout.strip().splitlines()


def find_kubectl() -> str | None:
    return shutil.which("kubectl")


# ---------------------------------------------------------------- the pod side: hpctrain run


def preempted_exit(run_dir: Path, code: int, limit: int | None) -> int:
    """``hpctrain run --preempted-exit CODE``: CODE for the ranks' exit 3 while this run was preempted
    at most ``limit`` times, then 3. Each preemption is counted once, by the time in the
    status.json its rank 0 wrote (every pod reads the same file on the shared volume, so all
    pods of one preemption agree), in ``RUN_DIR/k8s-preemptions.json``."""
    if limit is None:
        return code
    seen = _preemptions(run_dir)
    event = read_status(run_dir).get("time")
    if event not in seen:
        seen.append(event)
        write_json(run_dir / PREEMPTIONS_FILE, {"preemptions": seen})
    if len(seen) > limit:
        print(f"hpctrain run: preempted {len(seen)} times (--max-preemptions {limit}): exit 3, not retried",
              file=sys.stderr)
        return EXIT_PREEMPTED
    return code


def _preemptions(run_dir: Path) -> list[Any]:
    try:
        found = json.loads((run_dir / PREEMPTIONS_FILE).read_text()).get("preemptions", [])
    except (OSError, ValueError, AttributeError):  # none yet, or torn: count from here
        return []
    return list(found) if isinstance(found, list) else []
