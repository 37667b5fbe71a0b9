"""The whole configuration: the sections composed, read from YAML + ``key=value`` overrides.

Each section is a frozen keyword-only dataclass next to its component, with its own checks
(``data/config.py``, ``checkpoint/config.py``, ...; see :mod:`hpctrain.core.section`). This
module only composes them, reads YAML and overrides into them (unknown keys and wrong
types are errors naming the key), checks what spans sections, and generates the reference
(``hpctrain config doc`` > docs/config.md). A new section is one dataclass in its
component's folder plus one line in :class:`Config`.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from hpctrain.config.checkpoint import CheckpointConfig
from hpctrain.config.data import BatchSplit, DataConfig, batch_split
from hpctrain.config.model import ModelConfig, check_experts
from hpctrain.config.optim import OptimConfig
from hpctrain.config.parallel import ParallelConfig
from hpctrain.config.telemetry import TelemetryConfig
from hpctrain.config.train import RunConfig, TrainConfig
from hpctrain.core.safe_yaml import safe_yaml
from hpctrain.core.section import ConfigError, PrecisionMode, opt, sub, to_dict

__all__ = ["BatchSplit", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "ModelConfig", "OptimConfig",
           "ParallelConfig", "RunConfig", "TrainConfig", "check_world", "config_from_args", "for_world", "load_config",
           "reference_markdown", "split_config_args", "to_dict", "to_yaml"]


@dataclass(frozen=True, kw_only=True)
class Config:
    seed: int = opt(0, "Seed: model init and data order use it as is (same on every rank); dropout and other randomness use seed + rank.")
    precision: PrecisionMode = opt("fp32", "fp32 | bf16 (autocast) | fp16 (autocast + GradScaler loss scaling) | fp8 (torchao float8 linear layers + bf16 autocast; NVIDIA compute capability >= 9.0, else exit 2).")
    model: ModelConfig = sub(ModelConfig)
    data: DataConfig = sub(DataConfig)
    train: TrainConfig = sub(TrainConfig)
    optim: OptimConfig = sub(OptimConfig)
    parallel: ParallelConfig = sub(ParallelConfig)
    run: RunConfig = sub(RunConfig)
    checkpoint: CheckpointConfig = sub(CheckpointConfig)
    telemetry: TelemetryConfig = sub(TelemetryConfig)
    resume: str = opt("auto", "auto: continue from the newest committed checkpoint of run.dir (or of "
                      "checkpoint.remote's tier); never: start fresh; or a checkpoint PATH or s3:// URL.")


# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- ``key=value`` overrides, then validation."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for item in overrides or []:
        key, value = _split_override(item)
        _set_dotted(raw, key, value)
    cfg: Config = _build(Config, raw, prefix="")
    _check_across_sections(cfg)
    return cfg


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [key=value ...]`` as every command takes them: the one argument without '='
    is the YAML file, the others are overrides."""
    paths = [a for a in args if "=" not in a]
    if len(paths) > 1:
        raise ConfigError(f"expected at most one config file, got {paths}; overrides look like key=value")
    return (paths[0] if paths else None), [a for a in args if "=" in a]


def config_from_args(args: list[str]) -> Config:
    """The config of a command line's ``[CONFIG] [key=value ...]``."""
    return load_config(*split_config_args(args))


def _check_across_sections(cfg: Config) -> None:
    """What the user wrote, checked where it spans sections (each section checked itself)."""
    if cfg.data.global_batch_size is not None and cfg.train.grad_accum != 1:
        raise ConfigError(
            f"data.global_batch_size={cfg.data.global_batch_size} and train.grad_accum={cfg.train.grad_accum} "
            "are both set; hint: with a global batch the accumulation is derived (data.batch_size caps the "
            "micro-batch): leave train.grad_accum at 1")
    _check_fp8(cfg)
    check_experts(cfg.model, cfg.parallel)  # model.experts x parallel.ep / tp / pp


def _check_fp8(cfg: Config) -> None:
    """fp8 converts the model's linear layers before the strategy wraps it: refused where that
    conversion is not tested (tensor parallel's plans). A strategy refuses it itself where its
    wrapper does not take it (DeepSpeed's engine: hpctrain.parallel.deepspeed's check)."""
    if cfg.precision != "fp8":
        return
    if cfg.parallel.tp > 1:
        raise ConfigError(f"precision=fp8 with parallel.tp={cfg.parallel.tp} is not supported yet (float8 needs its "
                          "own tensor-parallel styles); hint: parallel.tp=1, or precision=bf16")


MAX_CONFIG_BYTES = 16 << 20  # a config is a few kB; a bigger file is a mistake (a data file, a dump)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (hint: pass a YAML file or only key=value overrides)")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path} is {size} bytes, more than a config holds ({MAX_CONFIG_BYTES}); "
                              "hint: is it the right file?")
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}; hint: check the path and its "
                          "permissions") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{data[err.start]:02x} on line {line}); "
                          "hint: save it as UTF-8") from None
    loaded = safe_yaml(text, f"config file {path}") or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded


class _RawText(str):
    """An override's text, read as YAML only once the field's type is known: a string field
    keeps it verbatim (YAML would turn `off` into false and `1e-3` into a string)."""


def _split_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not key=value (example: optim.lr=0.05)")
    return key.strip(), _RawText(text)


def _interpret(text: _RawText, hint: Any, key: str) -> Any:
    """The override's value as YAML reads it, except where the field takes text: there the text
    is kept verbatim unless YAML reads a list, a mapping or null. Text YAML cannot read (`id`,
    @x, %x, [x) is kept verbatim where text is allowed (``hint`` None: a free mapping's value),
    else it is one line of error naming the key."""
    takes_text = hint is None or _accepts_text(hint, str(text))
    try:
        parsed = safe_yaml(text, f"override {key}={str(text)!r}") if text.strip() else None
    except ConfigError:
        if takes_text:
            return str(text)
        raise
    if parsed is None and takes_text and hint is not None and not _accepts_none(hint):
        return str(text)  # run.dir=~ is the home folder's sign, not YAML's null, where None is not allowed
    if parsed is None or isinstance(parsed, (list, dict)):
        return parsed
    return str(text) if hint is not None and takes_text else parsed


def _accepts_none(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)


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
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{prefix}{name}.")
        elif isinstance(value, str) and value.strip().lower() in fields[name].metadata.get("none_text", ()):
            values[name] = None  # e.g. checkpoint.every_seconds=off: read as None here, never rewritten later
        else:
            values[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    if isinstance(value, _RawText):
        value = _interpret(value, hint, key)
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
    if origin is dict:  # a free mapping (optim.kwargs): its keys are the user's, its values kept as YAML reads them
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping (example: {key}.NAME=VALUE, or {key}: {{NAME: VALUE}} "
                              "in YAML)")
        return {str(k): _free_value(_interpret(v, None, f"{key}.{k}") if isinstance(v, _RawText) else v)
                for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list (example: {key}=[0.9,0.999])")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    return _coerce_scalar(value, hint, key)


def _free_value(value: Any) -> Any:
    """A mapping value of unknown type: YAML 1.1 reads 1e-6 (no dot) as text; a number is meant."""
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value):
        return float(value)
    return value


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


# ---------------------------------------------------------------- world size


def for_world(cfg: Config, world_size: int) -> Config:
    """The config as ``world_size`` ranks run it: ``data.batch_size`` = the micro-batch and
    ``train.grad_accum`` = the micro-steps of :func:`batch_split` (unchanged without
    ``data.global_batch_size``). A new value; ``cfg`` is untouched."""
    plan = batch_split(cfg.data, cfg.train.grad_accum, world_size)
    if (plan.micro_batch, plan.grad_accum) == (cfg.data.batch_size, cfg.train.grad_accum):
        return cfg
    return replace(cfg, data=replace(cfg.data, batch_size=plan.micro_batch),
                   train=replace(cfg.train, grad_accum=plan.grad_accum))


def check_world(cfg: Config, world_size: int) -> None:
    """Checks that depend on the number of ranks, done before init_process_group."""
    plan = batch_split(cfg.data, cfg.train.grad_accum, world_size)
    if cfg.data.max_train_samples is not None and cfg.data.max_train_samples < plan.global_batch:
        raise ConfigError(
            f"data.max_train_samples ({cfg.data.max_train_samples}) is smaller than one global batch: "
            f"data.batch_size ({plan.micro_batch}) x world_size ({world_size}) x train.grad_accum "
            f"({plan.grad_accum}) = {plan.global_batch}; hint: lower data.batch_size or raise max_train_samples"
        )


# ---------------------------------------------------------------- output


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# The prose after the generated tables of docs/config.md: what the loading refuses, and why.
REFUSED = '''
## What is refused, and why

**The run directory.** hpctrain writes only into a folder it creates, an empty folder, or a run
directory of its own: one holding its marker `.hpctrain-run.json` (written first, listing the
names hpctrain writes there). A folder with anything else in it is refused with exit 2, naming
what is there (`run.dir runs/x already holds files hpctrain did not write (checkpoints/,
config.yaml, model.pt, ...)`), even with `run.overwrite=true`: name a subfolder
(`run.dir=runs/x/run1`). Another tool's run holds the same names (`config.yaml`, `model.pt`,
`checkpoints/`), so names alone never make a folder hpctrain's. A run directory of an older
hpctrain (no marker) is recognised by its contents: a `config.yaml` with hpctrain's sections
(`model`, `data`, `train`, `optim`, `run`, `checkpoint`) and a `status.json` with hpctrain's
`outcome` and `time`, or the batch script `hpctrain slurm` wrote; it resumes as before and gets
the marker.

- `run.overwrite=true` replaces the previous run: it removes the outputs the marker lists
  (`summary.json`, `model.pt`, `metrics.jsonl`, `tensorboard/`, `profile/`, ...) and hpctrain's
  own entries of `checkpoints/` (`step-N`, `best.json`); a file hpctrain did not write
  (`checkpoints/epoch=3-step=1000.ckpt`, your notes) stays, byte for byte.
- `/`, the home folder (and the folders above it), and system folders (`/usr`, `/etc`, `/bin`,
  `/var`, `/tmp` itself, `/home`, anything under `/proc`, `/sys`, `/dev`, ...) are refused: a run
  there would write beside files that are not its own.
- `~` and environment variables are expanded (`run.dir=~/runs/a`, `run.dir=$SCRATCH/runs/{model.name}`);
  a variable that is not set is an error (exit 2), never a folder named `$SCRATCH`.
- A finished run (`summary.json`) is refused unless a larger `train.max_steps` or
  `train.epochs` than its config held asks for more steps than it ran: then it continues from
  its last checkpoint (the same command with the larger value, at any world size; the LR
  schedule is recomputed for the new length and logged). See [own-code.md](own-code.md#extending-a-finished-run).

**YAML.** A config file is read as UTF-8 (another encoding: exit 2 naming the file, the byte and
its line) of at most 16 MiB. Aliases (`*name`) are allowed, but a document whose values, with
every alias expanded, exceed 100,000 (a "billion laughs" bomb of 700 bytes expands to 387
million) or whose alias refers to itself is refused with exit 2 before anything is built: the
config is expanded when it is shown, checked and saved into every checkpoint. A syntax error
is one line with its line and column.

**Overrides.** `key=value` is read as YAML only where the key's type needs it. A text key keeps
what you typed: ``model.name=`id` ``, `run.dir=@x`, `run.dir=%x`, `data.path=[x`, `run.dir=~`
are those strings (a value YAML reads as a list, a mapping or null stays one where the key
allows it). A number or a switch YAML cannot read (``optim.lr=`x``) is exit 2 with one line.
'''


def reference_markdown(section: str | None = None) -> str:
    """The config reference, generated from the field docs (docs/config.md); ``section``
    (``optim``, ``data``, ...): that section's table alone (``hpctrain config doc optim``)."""
    if section is not None:
        return "\n".join(_section_rows(_section_class(section), f"{section}.")) + "\n"
    lines = ["# Configuration reference", "",
             "Generated by `hpctrain config doc`. Set keys in a YAML file or as `key=value` overrides.", ""]
    lines += _section_rows(Config, "")
    return "\n".join(lines) + REFUSED


def config_sections() -> dict[str, type]:
    """The sections of :class:`Config` by name (``model``, ``data``, ...)."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)
            if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])}


def key_names() -> dict[str, list[str]]:
    """Every key by section ("" = top level), for ``hpctrain train --help``."""
    out = {"": [f.name for f in dataclasses.fields(Config) if f.name not in config_sections()]}
    return out | {name: [f.name for f in dataclasses.fields(cls)] for name, cls in config_sections().items()}


def _section_class(section: str) -> type:
    sections = config_sections()
    if section not in sections:
        raise ConfigError(f"no config section {section!r}; choose one of: {', '.join(sections)} "
                          "(or no argument: the whole reference)")
    return sections[section]


def _section_rows(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    sections = []
    for f in dataclasses.fields(cls):
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name]):
            sections.append((f.name, hints[f.name]))
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        rows.append(f"| `{prefix}{f.name}` | {_type_name(hints[f.name])} | `{default}` | {f.metadata['help']} |")
    out = [f"## `{prefix.rstrip('.')}`" if prefix else "## top level", ""] + rows + [""]
    for name, cls_ in sections:
        out += _section_rows(cls_, f"{prefix}{name}.")
    return out


def _type_name(hint: Any) -> str:
    text = str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace("|", "\\|")
