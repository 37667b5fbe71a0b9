"""``hpctrain run | slurm | k8s | doctor``: the launchers' subcommands."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpctrain.checkpoint.preempt import keep_signals, signal_names
from hpctrain.config import config_from_args
from hpctrain.config.checkpoint import CheckpointConfig
from hpctrain.core.atomic import atomic_write_text
from hpctrain.core.errors import EXIT_PREEMPTED, UserError, io_error
from hpctrain.core.protocol import program_signals, read_status
from hpctrain.core.rundir import resolve_run_dir
from hpctrain.launch import DEFAULT_HANG_TIMEOUT_S, DEFAULT_SHUTDOWN_TIMEOUT_S, k8s, slurm
from hpctrain.launch.container import check_present, definition
from hpctrain.launch.doctor import render_text, report, summarise
from hpctrain.launch.program import user_program
from hpctrain.launch.slurm_jobs import cancel, status, submit


def add_parser(sub: Any) -> None:
    """Register ``run``, ``slurm`` (with ``status`` / ``cancel``), ``k8s`` and ``doctor``."""
    _add_run(sub)
    _add_slurm(sub)
    _add_k8s(sub)
    _add_doctor(sub)


# ---------------------------------------------------------------- run


def _add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="N local ranks via torchrun: hpctrain run -n 2 [train|eval] [CONFIG] [k=v]")
    p.add_argument("-n", "--nproc", type=int, required=True, help="processes (ranks) on this node")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun elastic restarts after a failure")
    p.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX for elastic jobs")
    p.add_argument("--node-rank", type=int, help="this node's rank (static rendezvous; c10d assigns it otherwise)")
    p.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous (multi-node)")
    p.add_argument("--rdzv-id", help="job id shared by all nodes of the rendezvous")
    p.add_argument("--shutdown-timeout", type=int, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="seconds the ranks get to save and exit after a forwarded signal before SIGKILL")
    p.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT_S,
                   help="seconds without progress before a rank counts as hung: stacks to RUN_DIR/hang-*/, "
                        "then a restart or exit 4 (first step, validation and saves get 3x; 0: off)")
    p.add_argument("--run-dir", type=Path, help="your own script: where hang reports go (default: .)")
    p.add_argument("--preempted-exit", type=int, metavar="CODE",
                   help="exit CODE instead of 3 after the ranks' preemption save (hpctrain k8s: the training "
                        "operator retries only exit codes >= 128)")
    p.add_argument("--max-preemptions", type=int, metavar="K",
                   help="with --preempted-exit: only while the run was preempted at most K times (counted in "
                        "RUN_DIR/k8s-preemptions.json), then exit 3")
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE [ARGS]",
                   help="run a Python module on each rank, as torchrun -m / python -m would")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="[train|eval] [CONFIG] [key=value ...] [--weights PATH], or SCRIPT.py [ARGS]")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from hpctrain.launch.local import launch  # torch (torchrun's agent): only `run` loads it

    rest = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    program = user_program(rest, args.module)
    if program is not None:
        return _run_program(args, program)
    if not rest or rest[0] not in ("train", "eval"):
        rest = ["train", *rest]
    # Fail here, once, not in N ranks: the ranks' command line checked by the CLI's own parser
    # (handed in by hpctrain.cli, which imports this module, not the other way round).
    cfg = config_from_args(args.parse_command(rest).config_args)
    # launch() puts back what it found: this recorder, so a second preemption signal after the ranks'
    # save (a repeated warning) cannot end the launcher with 138 before it reports their exit 3
    keep_signals(signal_names(cfg.checkpoint))
    started, run_dir = time.time(), resolve_run_dir(cfg.run.dir, cfg)
    _check_preempted_exit(args)
    code = launch(args.nproc, rest, max_restarts=args.max_restarts, nnodes=args.nnodes, node_rank=args.node_rank,
                  rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, signals=cfg.checkpoint.signals,
                  shutdown_timeout=args.shutdown_timeout, hang_timeout_s=args.hang_timeout, run_dir=run_dir)
    if rest[0] != "train":
        return code
    code = _launcher_exit_code(run_dir, code, started)
    if code == EXIT_PREEMPTED and args.preempted_exit is not None:
        return k8s.preempted_exit(run_dir, args.preempted_exit, args.max_preemptions)
    return code


def _check_preempted_exit(args: argparse.Namespace) -> None:
    if args.preempted_exit is not None and not 1 <= args.preempted_exit <= 255:
        raise UserError(f"--preempted-exit {args.preempted_exit} must be an exit code within 1..255")
    if args.max_preemptions is not None and (args.max_preemptions < 0 or args.preempted_exit is None):
        raise UserError(f"--max-preemptions {args.max_preemptions} must be >= 0 and goes with --preempted-exit")


def _launcher_exit_code(run_dir: Path, code: int, since: float) -> int:
    """torchrun reports a worker's exit 3 (or its own SIGTERM) as a failure; the run
    directory's status file, written after ``since``, tells a preemption apart from a crash."""
    recorded = read_status(run_dir)
    if recorded.get("outcome") == "preempted" and recorded.get("time", 0.0) >= since:
        return EXIT_PREEMPTED
    return code


def _run_program(args: argparse.Namespace, program: list[str]) -> int:
    """A user's script on N ranks: torchrun's environment, every preemption signal forwarded,
    the watchdog when the loop uses the meter, and the script's own exit code (3: requeue)."""
    from hpctrain.launch.local import launch  # torch (torchrun's agent): only `run` loads it

    signals = program_signals(CheckpointConfig().signals)
    keep_signals(signals)
    return launch(args.nproc, [], program=program, max_restarts=args.max_restarts, nnodes=args.nnodes,
                  node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                  signals=signals, shutdown_timeout=args.shutdown_timeout, hang_timeout_s=args.hang_timeout,
                  run_dir=args.run_dir or Path.cwd())


# ---------------------------------------------------------------- slurm


def _add_slurm(sub: Any) -> None:
    p = sub.add_parser("slurm", help="write (and submit) an sbatch script; `slurm status|cancel RUN_DIR`",
                       description="hpctrain slurm [CONFIG] [key=value ...] --nodes N --time T [options] "
                                   "[--dry-run | --submit];  hpctrain slurm --nodes N --time T [options] "
                                   "SCRIPT.py [ARGS] (or python -m MODULE [ARGS]; every word from the script on is "
                                   "the script's);  "
                                   "hpctrain slurm status|cancel RUN_DIR")
    p.__class__ = _SlurmParser  # a program's own options after SCRIPT.py are its own (as `hpctrain run` takes them)
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value] | status RUN_DIR | cancel RUN_DIR")
    p.add_argument("--nodes", type=int, help="nodes (one srun task each, starting that node's ranks)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node = ranks per node (0: CPU nodes)")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node on CPU nodes (default 1)")
    p.add_argument("--gres", help="instead of --gpus-per-node, e.g. gpu:a100:4 (must agree with it if both)")
    p.add_argument("--cpus-per-task", type=int, help="CPUs per node's task; OMP_NUM_THREADS = this / ranks per node "
                                                       "(left out: a warning, and the CPUs the job got / ranks)")
    p.add_argument("--mem", help="memory per node, e.g. 200G")
    p.add_argument("--time", help="wall-clock limit, HH:MM:SS (or any Slurm time format)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--qos")
    p.add_argument("--job-name", help="default hpctrain-<run dir name>")
    p.add_argument("--container", help="image: a .sif for apptainer, an image URI or .sqsh for pyxis")
    p.add_argument("--container-runtime", choices=["apptainer", "pyxis"])
    p.add_argument("--mount", action="append", default=[], help="extra host path for the container (repeatable)")
    p.add_argument("--setup", help="shell lines run first, e.g. 'module load cuda; source venv/bin/activate'")
    p.add_argument("--max-requeues", type=int, default=3, help="requeue a preempted run at most K times")
    p.add_argument("--signal", default="USR1", help="preemption signal Slurm sends before the time limit: USR1 "
                                                     "(default), USR2, HUP or TERM; the ranks' checkpoint.signals "
                                                     "follow (docs/cluster.md: which to pick)")
    p.add_argument("--signal-lead", type=int, help="seconds before the time limit for that signal (default: "
                                                     "measured save time x 2 + one validation + 90, else 300)")
    p.add_argument("--hang-timeout", type=float, help="passed to each node's `hpctrain run --hang-timeout` "
                                                      "(default: its own)")
    p.add_argument("--python", help="interpreter in the job (default: this one; python3 in a container)")
    p.add_argument("--rdzv-port", type=int, help="c10d rendezvous port (default: 20000 + job id mod 20000)")
    p.add_argument("--env", action="append", default=[],
                   help="NAME=VALUE exported in the job (written into the script), or NAME: passed from this "
                        "environment through sbatch's, written nowhere (repeatable); credentials (HF_TOKEN, "
                        "*_SECRET_*, *_KEY, ...) only as NAME; NCCL_*/GLOO_* of this shell are passed anyway")
    p.add_argument("--container-def", metavar="FILE",
                   help="write an Apptainer definition for this config's job (hpctrain with the extras and packages "
                        "it needs) to FILE and exit; then: apptainer build IMAGE.sif FILE")
    p.add_argument("--run-dir", help="your own program (SCRIPT.py or python -m MODULE after --): its run "
                                      "directory for logs and status (default runs/<script name>)")
    p.add_argument("--json", action="store_true", help="status: print JSON")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the script, write nothing")
    mode.add_argument("--submit", action="store_true", help="write the script, sbatch it, record the job id")
    p.set_defaults(func=cmd_slurm)


class _SlurmParser(argparse.ArgumentParser):
    """``hpctrain slurm [options] SCRIPT.py ARGS``: from the first script word on (``SCRIPT.py``,
    ``python ...``, or after ``--``), the words are the program's command line, its options
    included; the words before it are hpctrain slurm's own."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        head, program = _split_program(self, list(sys.argv[1:] if args is None else args))
        parsed, extra = super().parse_known_args(head, namespace)
        if program:
            parsed.config_args = [*parsed.config_args, *program]
        return parsed, extra


def _split_program(parser: argparse.ArgumentParser, words: list[str]) -> tuple[list[str], list[str]]:
    """(hpctrain slurm's words, the program's words): the program starts at ``--`` or at the first
    positional word that names a script (``*.py``, not a key=value) or a Python interpreter."""
    pythons = ("python", "python3", Path(sys.executable).name)
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return words[:i], words[i + 1 :]
        if word.startswith("-"):
            action = parser._option_string_actions.get(word.split("=", 1)[0])
            i += 2 if action is not None and action.nargs != 0 and "=" not in word else 1  # skip its value
            continue
        if "=" not in word and (word.endswith(".py") or Path(word).name in pythons):
            return words[:i], words[i:]
        i += 1
    return words, []


def cmd_slurm(args: argparse.Namespace) -> int:
    action = args.config_args[:1]
    if action in (["status"], ["cancel"]):
        if len(args.config_args) != 2:
            raise UserError(f"hpctrain slurm {action[0]} takes one RUN_DIR, got {args.config_args[1:]}")
        return _slurm_status(Path(args.config_args[1]), args.json) if action == ["status"] else \
            _slurm_cancel(Path(args.config_args[1]))
    return _slurm_write(args)


def _slurm_write(args: argparse.Namespace) -> int:
    if args.container_def:
        return _container_def(Path(args.container_def), args.config_args)
    missing = [f"--{name}" for name in ("nodes", "time") if getattr(args, name) is None]
    if missing:
        raise UserError(f"hpctrain slurm needs {' and '.join(missing)}; e.g. --nodes 2 --time 04:00:00")
    opts = slurm.SlurmOptions(
        nodes=args.nodes, time=args.time, gpus_per_node=args.gpus_per_node, nproc_per_node=args.nproc_per_node,
        gres=args.gres, cpus_per_task=args.cpus_per_task, mem=args.mem, partition=args.partition,
        account=args.account, qos=args.qos, job_name=args.job_name, container=args.container,
        container_runtime=args.container_runtime, mounts=tuple(args.mount), setup=args.setup,
        max_requeues=args.max_requeues, signal_lead_s=args.signal_lead, python=args.python,
        rdzv_port=args.rdzv_port, env=tuple(args.env), signal=args.signal, hang_timeout_s=args.hang_timeout,
        run_dir=args.run_dir)
    job = slurm.sbatch_job(opts, args.config_args)
    text = slurm.render(job)
    for warning in slurm.job_warnings(job):
        print(f"hpctrain slurm: warning: {warning}", file=sys.stderr)
    if args.dry_run:
        sys.stdout.write(text)
        return 0
    if job.container is not None:  # the image and its runtime, before a job waits in the queue for nothing
        check_present(job.container)
    script = slurm.write_script(job, text)
    if not args.submit:
        print(f"wrote {script}; submit with: sbatch {script}  (or hpctrain slurm ... --submit)")
        return 0

    job_id = submit(script, job.run_dir, opts.nodes)
    print(f"submitted job {job_id}: {script}")
    print(f"logs: {job.run_dir}/slurm-{job_id}.out; status: hpctrain slurm status {job.run_dir}")
    return 0


def _container_def(path: Path, config_args: list[str]) -> int:
    """``--container-def FILE``: the definition of the image this config's job needs."""
    text = definition(slurm.image_needs(config_args))
    try:
        atomic_write_text(path, text)
    except OSError as err:
        raise io_error("write the container definition", path, err) from err
    print(f"wrote {path}; build the image with: apptainer build {path.with_suffix('.sif')} {path}")
    return 0


def _slurm_status(run_dir: Path, as_json: bool) -> int:
    info = status(run_dir)
    if as_json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:<16} {', '.join(value) if isinstance(value, list) else value}")
    return 0


def _slurm_cancel(run_dir: Path) -> int:
    print(f"cancelled job {cancel(run_dir)}")
    return 0


# ---------------------------------------------------------------- k8s


def _add_k8s(sub: Any) -> None:
    p = sub.add_parser("k8s", help="write (and apply) a Kubernetes PyTorchJob or JobSet for the same job",
                       description="hpctrain k8s [CONFIG] [key=value ...] --nodes N --image IMAGE --pvc CLAIM "
                                   "[options] [--dry-run]: one pod per node running hpctrain run; without "
                                   "--dry-run the manifest goes to RUN_DIR/" + k8s.MANIFEST_NAME + " and, with "
                                   "kubectl on PATH, through kubectl apply (docs/cluster.md, Kubernetes)")
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value]")
    p.add_argument("--kind", choices=list(k8s.KINDS), default=k8s.DEFAULT_KIND,
                   help="pytorchjob (Kubeflow training operator v1, default) or jobset (JobSet v0.6+)")
    p.add_argument("--nodes", type=int, help="pods, one per node")
    p.add_argument("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu per pod = ranks per pod")
    p.add_argument("--nproc-per-node", type=int, help="ranks per pod without GPUs (default 1)")
    p.add_argument("--image", help="container image with hpctrain and torch, e.g. registry.example.com/me/hpctrain:1")
    p.add_argument("--pvc", help="PersistentVolumeClaim (ReadWriteMany) every pod mounts: the run directory")
    p.add_argument("--pvc-path", default=k8s.DEFAULT_PVC_PATH, help="where the claim is mounted; a relative "
                                                                    "run.dir goes under it")
    p.add_argument("--cpu", help="CPUs per pod (requests = limits), e.g. 32; OMP_NUM_THREADS = this / ranks")
    p.add_argument("--memory", help="memory per pod (requests = limits), e.g. 200Gi")
    p.add_argument("--shm-size", help="/dev/shm for loader workers (a memory emptyDir), e.g. 16Gi (default: "
                                      "bounded by the pod's memory)")
    p.add_argument("--name", help="the job's name (default hpctrain-<run dir name>)")
    p.add_argument("--namespace")
    p.add_argument("--max-restarts", type=int, default=3, help="restart a preempted job at most K times")
    p.add_argument("--grace", type=int, help="seconds the ranks get to save after SIGTERM (default: measured "
                                             "save time x 2 + one validation + 90, else 300)")
    p.add_argument("--port", type=int, default=k8s.DEFAULT_PORT, help="rendezvous port of pod 0")
    p.add_argument("--python", default="python3", help="interpreter in the image")
    p.add_argument("--env", action="append", default=[],
                   help="NAME=VALUE set in the pods (written into the manifest), or NAME: from this environment "
                        "through the Secret <name>-env, written nowhere (repeatable); credentials only as NAME")
    p.add_argument("--dry-run", action="store_true", help="print the manifest, write and apply nothing")
    p.set_defaults(func=cmd_k8s)


def cmd_k8s(args: argparse.Namespace) -> int:
    missing = [f"--{name}" for name in ("nodes", "image", "pvc") if getattr(args, name) is None]
    if missing:
        raise UserError(f"hpctrain k8s needs {', '.join(missing)}; e.g. --nodes 2 --image "
                        "registry.example.com/me/hpctrain:1 --pvc shared-runs")
    opts = k8s.K8sOptions(
        nodes=args.nodes, image=args.image, pvc=args.pvc, kind=args.kind, gpus_per_node=args.gpus_per_node,
        nproc_per_node=args.nproc_per_node, cpu=args.cpu, memory=args.memory, shm_size=args.shm_size,
        pvc_path=args.pvc_path, name=args.name, namespace=args.namespace, max_restarts=args.max_restarts,
        grace_s=args.grace, port=args.port, python=args.python, env=tuple(args.env))
    job = k8s.k8s_job(opts, args.config_args)
    text = k8s.dump(k8s.render(job))
    if args.dry_run:
        sys.stdout.write(text)
        if job.passed:
            print(f"# --env {' '.join(job.passed)}: hpctrain k8s creates the Secret {job.secret_name} from this "
                  f"environment when it applies the manifest; by hand: {k8s.secret_hint(job)}")
        return 0
    path = k8s.write_manifest(job, text)
    kubectl = k8s.find_kubectl()
    if kubectl is None:
        secret = f"; first: {k8s.secret_hint(job)}" if job.passed else ""
        print(f"wrote {path}; kubectl is not on PATH here: apply it with kubectl apply -f {path}{secret}")
        return 0
    for line in k8s.apply(job, path, os.environ, kubectl):
        print(line)
    print(f"applied {path}; pods: kubectl get pods -l app.kubernetes.io/instance={job.name}")
    return 0


# ---------------------------------------------------------------- doctor


def _add_doctor(sub: Any) -> None:
    p = sub.add_parser("doctor", help="what a job sees on this node (or every node) and common mistakes")
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value]", help="to check run.dir and data.path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--nproc", type=int, help="ranks per node you plan (for the thread check)")
    p.add_argument("--all-nodes", action="store_true",
                   help="inside an allocation: run on every node via srun and summarise per node")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.all_nodes:
        return _doctor_all_nodes(args)

    run_dir, data_dir, staged = _doctor_paths(args.config_args)
    rep = report(run_dir=run_dir, data_dir=data_dir, staged=staged, local_ranks=args.nproc)
    sys.stdout.write(json.dumps(rep) + "\n" if args.json else render_text(rep))
    return 0


def _doctor_paths(config_args: list[str]) -> tuple[Path | None, Path | None, bool]:
    if not config_args:
        return None, None, False

    cfg = config_from_args(config_args)
    stage = cfg.data.stage_dir
    return (resolve_run_dir(cfg.run.dir, cfg), Path(cfg.data.path) if cfg.data.path else None,
            stage is not None and stage != "off")


def _doctor_all_nodes(args: argparse.Namespace) -> int:
    if "SLURM_JOB_ID" not in os.environ:
        raise UserError("--all-nodes runs srun inside an allocation; hint: salloc -N 2, or in a batch script")
    cmd = ["srun", f"--nodes={os.environ.get('SLURM_NNODES', '1')}", "--ntasks-per-node=1",
           sys.executable, "-m", "hpctrain", "doctor", "--json", *args.config_args]
    if args.nproc:
        cmd.append(f"--nproc={args.nproc}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    reports = _json_objects(proc.stdout)
    if proc.returncode != 0 or not reports:
        raise UserError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    sys.stdout.write(json.dumps(reports) + "\n" if args.json else summarise(reports))
    return 0


def _json_objects(text: str) -> list[dict[str, Any]]:
    """One JSON object per line (one per node), ignoring anything else a task printed."""
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    return found
