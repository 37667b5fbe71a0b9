"""Typed configuration: one dataclass per section, YAML file + ``key=value`` overrides.

Every field is documented once, in its ``help`` metadata; that text is also the CLI
reference (``hpctrain config doc``). Loading validates everything before any process
group starts, and every error names the key, the value and a hint.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from hpctrain.errors import UserError


class ConfigError(UserError):
    """A configuration value or key is wrong; the message says which and how to fix it."""


def opt(default: Any, help: str) -> Any:
    """A config field with its documentation."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    name: str = opt("mnist_cnn", "Registered model (`hpctrain models`) or a user factory as `package.module:function`.")
    num_classes: int | None = opt(None, "Output classes; default: taken from the dataset.")


@dataclass
class DataConfig:
    name: str = opt("mnist", "Dataset: mnist | fashion_mnist | synthetic_cifar | synthetic_tiny | shards (tar shards from `hpctrain data shard`, at data.path).")
    path: str | None = opt(None, "Data location for sources that read files (default: the installed package); for shards: the shard directory.")
    batch_size: int = opt(64, "Samples per rank per micro-step (global batch = batch_size x world_size x grad_accum).")
    eval_batch_size: int | None = opt(None, "Samples per rank per validation batch; default: 2 x batch_size.")
    num_workers: int = opt(0, "DataLoader worker processes per rank (0 = load in the training process).")
    prefetch_factor: int = opt(2, "Batches each worker keeps ready (only with num_workers > 0).")
    pin_memory: bool = opt(True, "Pin host memory for faster host-to-GPU copies (ignored on CPU).")
    persistent_workers: bool = opt(True, "Keep workers alive between epochs (only with num_workers > 0).")
    max_train_samples: int | None = opt(None, "Use only the first N training samples (quick runs, tests).")
    max_val_samples: int | None = opt(None, "Use only the first N validation samples.")
    val_split: Literal["val", "test"] = opt("val", "Which held-out split validates: val (MNIST's 10k validation) or test.")
    synthetic_size: int = opt(20000, "Samples in a synthetic training set (synthetic_* datasets).")
    drop_last: bool = opt(True, "Drop the last incomplete training batch so every step has the same global batch (shards: false pads the last step with masked samples instead).")
    shuffle: Literal["global", "shard", "window", "none"] = opt("shard", "Shards: order within an epoch; global = one permutation of all samples, shard = shards and samples within each shard shuffled, window = shuffled windows of shuffle_window samples (near-sequential reads), none = file order.")
    shuffle_window: int = opt(1000, "Shards: samples per window for shuffle=window.")
    stage_dir: str | None = opt(None, "Shards: node-local directory to copy the shards to first (local rank 0 copies, verifies, others wait); default $SLURM_TMPDIR when set; off = read data.path directly.")
    on_corrupt: Literal["stop", "skip"] = opt("stop", "Shards: a truncated or corrupt sample stops the run (naming shard and key), or is skipped, logged and counted.")


@dataclass
class TrainConfig:
    epochs: int = opt(1, "Passes over the training data.")
    max_steps: int | None = opt(None, "Stop after this many optimizer steps (overrides epochs when reached first).")
    grad_accum: int = opt(1, "Micro-steps per optimizer step; inner micro-steps skip the gradient all-reduce.")
    clip_grad_norm: float | None = opt(None, "Clip the global gradient norm to this value (None = off).")
    log_every: int = opt(20, "Write a metrics.jsonl row every N optimizer steps.")
    eval_every_steps: int | None = opt(None, "Validate every N optimizer steps (besides each epoch end).")
    eval_each_epoch: bool = opt(True, "Validate at the end of every epoch.")
    best_metric: str = opt("val_accuracy", "Validation metric whose best value is tracked (its checkpoint marked): val_accuracy, val_loss, val_top5_accuracy, ...")
    best_mode: Literal["auto", "max", "min"] = opt("auto", "Is higher better? auto: min for *loss / *perplexity, else max.")
    compile: bool = opt(False, "Wrap the model in torch.compile (opt-in: compilation takes time).")
    deterministic: bool = opt(False, "Deterministic kernels (torch.use_deterministic_algorithms); slower.")
    progress: bool = opt(True, "Show a progress bar over steps on rank 0 (only when the console is a terminal or forced).")
    threads: int | None = opt(None, "torch intra-op threads per rank; default: cores / local ranks.")


@dataclass
class OptimConfig:
    name: Literal["sgd", "adamw"] = opt("sgd", "Optimizer: sgd | adamw.")
    lr: float = opt(0.1, "Peak learning rate (after warmup and scaling).")
    momentum: float = opt(0.9, "SGD momentum.")
    nesterov: bool = opt(False, "SGD Nesterov momentum.")
    weight_decay: float = opt(0.0, "Weight decay (decoupled for adamw).")
    betas: list[float] = opt([0.9, 0.999], "AdamW betas.")
    warmup_steps: int = opt(0, "Linear warmup from 0 to lr over this many optimizer steps.")
    schedule: Literal["constant", "cosine", "step"] = opt("cosine", "LR schedule after warmup: constant | cosine | step.")
    min_lr_ratio: float = opt(0.0, "Cosine floor as a fraction of lr.")
    step_size: int = opt(1000, "Step schedule: multiply by gamma every step_size optimizer steps.")
    gamma: float = opt(0.1, "Step schedule decay factor.")
    scale_lr: Literal["none", "linear"] = opt("none", "linear: lr x global_batch / base_batch (Goyal et al.).")
    base_batch: int = opt(64, "Reference global batch for scale_lr=linear.")


@dataclass
class ParallelConfig:
    strategy: Literal["ddp"] = opt("ddp", "Data-parallel strategy (ddp; FSDP/ZeRO arrive with the sharded-training issue).")
    backend: Literal["auto", "nccl", "gloo"] = opt("auto", "Process-group backend; auto = nccl with CUDA, else gloo.")
    init_timeout_s: float = opt(600.0, "Seconds to wait for all ranks in init_process_group and collectives.")
    bucket_cap_mb: float = opt(25.0, "DDP gradient bucket size in MiB.")
    gradient_as_bucket_view: bool = opt(True, "DDP: gradients are views into buckets (saves a copy and memory).")
    static_graph: bool = opt(False, "DDP: the graph is the same every step (enables extra optimizations).")
    find_unused_parameters: bool = opt(False, "DDP: search for parameters that get no gradient (slower).")
    broadcast_buffers: bool = opt(True, "DDP: broadcast buffers (e.g. BatchNorm stats) from rank 0 each forward.")


@dataclass
class RunConfig:
    dir: str = opt("runs/{data.name}-{model.name}", "Run directory (may name config keys in braces): config.yaml, metrics.jsonl, model.pt, summary.json.")
    overwrite: bool = opt(False, "Allow writing into a run directory that already holds a finished run.")


@dataclass
class CheckpointConfig:
    enabled: bool = opt(True, "Write checkpoints to RUN_DIR/checkpoints/ (committed: files, then manifest, then rename).")
    every_steps: int | None = opt(None, "Save every N optimizer steps (None = no step schedule).")
    every_seconds: str | None = opt("3600", "Save every T seconds of wall clock; `auto` = Young-Daly sqrt(2 x measured save cost x mtbf_hours); None = off.")
    mtbf_hours: float = opt(2.0, "Mean time between failures of the whole job, for every_seconds=auto.")
    at_end: bool = opt(True, "Save when training ends (so a finished run can be exported or extended).")
    on_best: bool = opt(False, "Also save whenever the tracked validation metric improves (its checkpoint is named in checkpoints/best.json).")
    mode: Literal["sync", "async"] = opt("sync", "sync: the loop waits for the write; async: a background thread copies the state (before the next optimizer.step) and writes it; one save in flight.")
    format: Literal["torch", "dcp"] = opt("torch", "torch: rank 0 writes replicated state as one file; dcp: torch.distributed.checkpoint, every rank its shard (reshardable).")
    local_dir: str | None = opt(None, "Two-tier: write to this node-local directory first, then copy to the run directory in the background.")
    stagger_seconds: float = opt(0.0, "Two-tier: node k waits k x this before copying to the shared file system.")
    keep_last: int = opt(3, "Keep the newest K committed checkpoints (>= 1).")
    keep_every: int | None = opt(None, "Also keep every checkpoint whose step is a multiple of M.")
    signals: list[str] = opt(["SIGUSR1", "SIGTERM"], "Signals that request save-and-exit (preemption): any of SIGUSR1, SIGUSR2, SIGTERM, SIGINT.")
    signal_check_every: int = opt(1, "Steps between the all-reduce that agrees on a signal / wall-clock save (multi-rank only).")

    def __post_init__(self) -> None:
        from hpctrain.checkpoint.policy import validate_checkpoint_config

        validate_checkpoint_config(self)


Precision = Literal["fp32", "bf16", "fp16"]


@dataclass
class Config:
    seed: int = opt(0, "Seed: model init and data order use it as is (same on every rank); dropout and other randomness use seed + rank.")
    precision: Precision = opt("fp32", "fp32 | bf16 (autocast) | fp16 (autocast + GradScaler loss scaling).")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume: str = opt("auto", "auto: continue from the newest committed checkpoint of run.dir; never: start fresh; or a checkpoint PATH.")


# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- ``key=value`` overrides, then validation."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for item in overrides or []:
        key, value = _split_override(item)
        _set_dotted(raw, key, value)
    cfg = _build(Config, raw, prefix="")
    validate(cfg)
    return cfg


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (hint: pass a YAML file or only key=value overrides)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


class _RawText(str):
    """An override's text, read as YAML only once the field's type is known: a string field
    keeps it verbatim (YAML would turn `off` into false and `1e-3` into a string)."""


def _split_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not key=value (example: optim.lr=0.05)")
    return key.strip(), _RawText(text)


def _interpret(text: _RawText, hint: Any) -> Any:
    parsed = yaml.safe_load(text) if text.strip() else None
    if parsed is None or isinstance(parsed, (list, dict)):
        return parsed
    return str(text) if _accepts_text(hint, str(text)) else parsed


def _accepts_text(hint: Any, text: str) -> bool:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_accepts_text(a, text) for a in args)
    if origin is Literal:
        return text in args
    return hint is str


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"section {prefix.rstrip('.') or '<root>'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"section '{prefix.rstrip('.')}'" if prefix else "the top level"
        raise ConfigError(
            f"unknown key '{prefix}{unknown[0]}' in {where}; valid keys: {', '.join(sorted(fields))}"
        )
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            values[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    if isinstance(value, _RawText):
        value = _interpret(value, hint)
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list (example: {key}=[0.9,0.999])")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    return _coerce_scalar(value, hint, key)


def _coerce_scalar(value: Any, hint: type, key: str) -> Any:
    wrong = ConfigError(f"{key}={value!r} must be of type {hint.__name__} (got {type(value).__name__})")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong
        return value
    if hint is float:
        if isinstance(value, bool):
            raise wrong
        try:  # YAML reads 1e-3 as a string; accept it as a number
            return float(value)
        except (TypeError, ValueError):
            raise wrong from None
    if hint is str:
        if isinstance(value, bool):  # YAML 1.1 reads off/no/yes as booleans
            raise ConfigError(f"{key}={value!r} must be text; hint: quote it in YAML, e.g. {key.split('.')[-1]}: 'off'")
        if isinstance(value, (dict, list)) or value is None:
            raise wrong
        return str(value)
    raise wrong


# ---------------------------------------------------------------- validation


def _positive(key: str, value: float | int | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{key}={value!r} must be > 0")


def validate(cfg: Config) -> None:
    """Checks that need no process group; world-size checks are in :func:`check_world`."""
    for key, value in [
        ("data.batch_size", cfg.data.batch_size),
        ("data.eval_batch_size", cfg.data.eval_batch_size),
        ("data.max_train_samples", cfg.data.max_train_samples),
        ("data.max_val_samples", cfg.data.max_val_samples),
        ("data.prefetch_factor", cfg.data.prefetch_factor),
        ("train.epochs", cfg.train.epochs),
        ("train.max_steps", cfg.train.max_steps),
        ("train.grad_accum", cfg.train.grad_accum),
        ("train.clip_grad_norm", cfg.train.clip_grad_norm),
        ("train.log_every", cfg.train.log_every),
        ("train.eval_every_steps", cfg.train.eval_every_steps),
        ("train.threads", cfg.train.threads),
        ("optim.lr", cfg.optim.lr),
        ("optim.base_batch", cfg.optim.base_batch),
        ("optim.step_size", cfg.optim.step_size),
        ("parallel.init_timeout_s", cfg.parallel.init_timeout_s),
        ("parallel.bucket_cap_mb", cfg.parallel.bucket_cap_mb),
    ]:
        _positive(key, value)
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers} must be >= 0")
    if cfg.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps} must be >= 0")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be within [0, 1]")
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas={cfg.optim.betas} must be two numbers in [0, 1)")


def check_world(cfg: Config, world_size: int) -> None:
    """Checks that depend on the number of ranks, done before init_process_group."""
    if cfg.data.max_train_samples is not None:
        per_step = cfg.data.batch_size * world_size * cfg.train.grad_accum
        if cfg.data.max_train_samples < per_step:
            raise ConfigError(
                f"data.max_train_samples ({cfg.data.max_train_samples}) is smaller than one global batch: "
                f"data.batch_size ({cfg.data.batch_size}) x world_size ({world_size}) x train.grad_accum "
                f"({cfg.train.grad_accum}) = {per_step}; hint: lower data.batch_size or raise max_train_samples"
            )


# ---------------------------------------------------------------- output


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def reference_markdown() -> str:
    """The config reference, generated from the field docs (docs/config.md)."""
    lines = ["# Configuration reference", "",
             "Generated by `hpctrain config doc`. Set keys in a YAML file or as `key=value` overrides.", ""]
    lines += _section_rows(Config, "")
    return "\n".join(lines) + "\n"


def _section_rows(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    sections = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            sections.append((f.name, hints[f.name]))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append(f"| `{prefix}{f.name}` | {_type_name(hints[f.name])} | `{default}` | {f.metadata['help']} |")
    out = [f"## `{prefix.rstrip('.')}`" if prefix else "## top level", ""] + rows + [""]
    for name, sub in sections:
        out += _section_rows(sub, f"{prefix}{name}.")
    return out


def _type_name(hint: Any) -> str:
    text = str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace("|", "\\|")
