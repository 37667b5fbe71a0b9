"""``hpctrain eval``: validation only, from saved weights, at any world size."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint import layout
from hpctrain.config import Config
from hpctrain.config.mix import data_text
from hpctrain.core import env as cluster
from hpctrain.core.atomic import write_json
from hpctrain.core.errors import HpctrainError, UserError, agree
from hpctrain.data import build_val_loader
from hpctrain.evaluation.evaluate import evaluate, write_predictions
from hpctrain.models.registry import resolve_num_classes
from hpctrain.precision import Precision
from hpctrain.tasks import Task, data_targets, resolve_task
from hpctrain.tasks.inputs import build_task_model
from hpctrain.tasks.metrics import user_metrics
from hpctrain.weights.frozen import load_trained, read_base_record
from hpctrain.weights.load import load_weights_file
from hpctrain.weights.locate import ONE, checkpoint_source, locate, newest_intact

log = logging.getLogger("hpctrain")
MODEL_FILE = "model.pt"  # what a finished run leaves in its directory


class WeightsError(UserError):
    """The weights file is missing or does not fit the model."""


class EvalOutputError(UserError):
    """eval.json or predictions.jsonl cannot be written."""


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """A weights file (``model.pt``, a state dict file), or what :func:`weights_source` found in
    a directory (a run's model.pt, or a committed checkpoint's model tensors)."""
    if path.is_dir():
        _load_checkpoint_weights(model, _found(path))
        return
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist; hint: pass a run directory, its checkpoints/ folder, "
                           "one checkpoint (RUN_DIR/checkpoints/step-N) or a weights file (RUN_DIR/model.pt)")
    try:
        state = load_weights_file(path)  # checked against the crafted-file limits before torch reads it
    except HpctrainError:
        raise
    except Exception as err:  # not a torch file, truncated, or pickled objects weights_only refuses
        raise WeightsError(f"weights file {path} cannot be loaded as a state dict ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}); hint: pass a run's model.pt, or "
                           "export a checkpoint with `hpctrain ckpt export RUN_DIR OUT.pt`") from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise WeightsError(f"weights file {path} holds a {type(state).__name__}, not a state dict; hint: save "
                           "model.state_dict(), or pass a run's model.pt")
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise WeightsError(f"weights {path} do not fit model: {str(err).splitlines()[0]}") from err


def weights_source(path: Path) -> tuple[Path, str]:
    """(what ``--weights PATH`` loads, how to say it): a file as given; a run directory's
    model.pt (the finished run's weights) where it has one; else the newest intact committed
    checkpoint of the run directory, checkpoints/ folder or checkpoint ``path`` names (nothing
    there: :class:`~hpctrain.checkpoint.layout.NoCheckpointError`, exit 2)."""
    if not path.is_dir():
        return path, f"weights file {path}"
    if (path / MODEL_FILE).is_file() and not (path / layout.MANIFEST).is_file():
        return path / MODEL_FILE, f"{path / MODEL_FILE} (the run's final weights)"
    found, located = _found(path), locate(path)
    among = "" if located.kind == ONE else f"; the newest intact of the {located.describe()}"
    return found.path, f"checkpoint {found.path} (step {found.step}{among})"


def _found(path: Path) -> layout.Found:
    found = newest_intact(locate(path))
    if found.problems:
        raise layout.CheckpointError(f"checkpoint {found.path} is corrupt: {'; '.join(found.problems)}; hint: "
                                     f"`hpctrain ckpt verify {found.path}`")
    return found


def _load_checkpoint_weights(model: torch.nn.Module, found: layout.Found) -> None:
    """A committed checkpoint's model tensors (any format, one at a time from its files) into
    ``model``; a frozen-base (LoRA) checkpoint holds only the trained tensors: the base comes
    from the model as built, checked against the checkpoint's digest of it."""
    source = checkpoint_source(found.path)
    state = {spec.name: tensor for spec, tensor in zip(source.specs, source.tensors, strict=True)
             if tensor is not None}  # no process group: every tensor comes whole
    try:
        load_trained(model, state, read_base_record(found.path), found.path)
    except RuntimeError as err:
        raise WeightsError(f"checkpoint {found.path} does not fit the model: {str(err).splitlines()[0]}") from err


def run_eval(cfg: Config, weights: Path, out_dir: Path | None = None, predictions: bool = False) -> dict[str, Any]:
    """``weights``: a weights file, a run directory, its checkpoints/ folder or one checkpoint
    (see :func:`weights_source`); the results go to ``out_dir``, else to the run directory."""
    env = cluster.detect()
    device = cluster.init_distributed(env, cfg.parallel.backend, cfg.parallel.init_timeout_s)
    try:
        weights, which = agree("finding the weights to evaluate", lambda: weights_source(weights))
        if env.is_main:
            log.info("eval: weights from %s", which)
        # Every rank loads; one rank's failure fails all of them here, never in evaluate's collectives.
        loader, num_classes, model, task = agree("loading the eval data and weights",
                                                 lambda: _prepare(cfg, env, weights))
        metrics = [*task.metrics(num_classes), *user_metrics(cfg.train.metrics)]
        result = evaluate(model.to(device), loader, metrics, env, device,
                          Precision(cfg.precision, device), collect_predictions=predictions, task=task)
        report = {**result.metrics, "samples_per_s": result.samples_per_s, "world_size": env.world_size,
                  "weights": str(weights), "split": cfg.data.val_split, "data": data_text(cfg.data), "task": task.name}
        target = out_dir or _run_dir_of(weights)
        rows = named_predictions(result.predictions, loader) if predictions else None
        agree("writing the eval results", lambda: _write(report, rows, target) if env.is_main else None)
        return report
    finally:
        cluster.teardown()


def _run_dir_of(weights: Path) -> Path:
    """Where eval.json goes by default: next to a weights file, or the run directory of a
    checkpoint (RUN/checkpoints/step-N -> RUN), never inside a committed checkpoint."""
    if (weights / layout.MANIFEST).is_file():
        return weights.parent.parent if weights.parent.name == "checkpoints" else weights.parent
    return weights.parent


def named_predictions(rows: list[dict[str, Any]], loader: Any) -> list[dict[str, Any]]:
    """Prediction rows keyed by the dataset's own sample names where it has them (an image
    folder's file names, ``sample_name(index)``), the index kept as ``index``; else as they are."""
    name_of = _sample_names(loader)
    if name_of is None:
        return rows
    return [{**row, "key": name_of(int(row["key"])), "index": row["key"]} for row in rows]


def _sample_names(loader: Any) -> Any:
    """``sample_name`` of the dataset inside the loader's wrappers (each holds the next as ``dataset``)."""
    inner = getattr(loader, "dataset", None)
    for _ in range(4):  # loader -> items -> (subset ->) the user's dataset
        name_of = getattr(inner, "sample_name", None)
        if callable(name_of):
            return name_of
        inner = getattr(inner, "dataset", None)
    return None


def _prepare(cfg: Config, env: cluster.ClusterEnv, weights: Path) -> tuple[Any, int, torch.nn.Module, Task]:
    val = build_val_loader(cfg.data, env, seed=cfg.seed, seq_len=cfg.model.seq_len,
                           num_classes=cfg.model.num_classes, targets=data_targets(cfg.train.task, cfg.train.loss))
    task = resolve_task(cfg.train.task, val.layout.task, cfg.data.name, loss=cfg.train.loss,
                        class_targets=val.layout.class_targets)
    num_classes = resolve_num_classes(cfg.model, val.layout.num_classes, val.layout.input_shape,
                                      val.layout.input_dtype, cfg.data.name)
    model = build_task_model(task, cfg.model.name, num_classes, val.layout.input_shape, val.layout.input_dtype,
                             cfg.model)
    load_weights(model, weights)
    return val.loader, num_classes, model, task


def _write(report: dict[str, Any], predictions: list[dict[str, Any]] | None, target: Path) -> None:
    """eval.json and predictions.jsonl, each whole or not at all (rank 0)."""
    try:
        target.mkdir(parents=True, exist_ok=True)
        if predictions is not None:
            write_predictions(predictions, target / "predictions.jsonl")
        write_json(target / "eval.json", report)
    except OSError as err:
        raise EvalOutputError(f"cannot write the eval results to {target}: {err}; hint: pass --out DIR "
                              "(a writable directory)") from err
    shown = ("count", "tokens", "correct", "accuracy", "loss", "perplexity", "mae", "f1")
    log.info("eval: %s -> %s", "  ".join(f"{k} {report[k]:.6g}" for k in shown if k in report), target / "eval.json")
