"""``hpctrain eval``: validation only, from saved weights, at any world size."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

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
from hpctrain.weights.load import load_weights_file

log = logging.getLogger("hpctrain")


class WeightsError(UserError):
    """The weights file is missing or does not fit the model."""


class EvalOutputError(UserError):
    """eval.json or predictions.jsonl cannot be written."""


def load_weights(model: torch.nn.Module, path: Path) -> None:
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist; hint: a run writes RUN_DIR/model.pt")
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


def run_eval(cfg: Config, weights: Path, out_dir: Path | None = None, predictions: bool = False) -> dict[str, Any]:
    env = cluster.detect()
    device = cluster.init_distributed(env, cfg.parallel.backend, cfg.parallel.init_timeout_s)
    try:
        # Every rank loads; one rank's failure fails all of them here, never in evaluate's collectives.
        loader, num_classes, model, task = agree("loading the eval data and weights",
                                                 lambda: _prepare(cfg, env, weights))
        metrics = [*task.metrics(num_classes), *user_metrics(cfg.train.metrics)]
        result = evaluate(model.to(device), loader, metrics, env, device,
                          Precision(cfg.precision, device), collect_predictions=predictions, task=task)
        report = {**result.metrics, "samples_per_s": result.samples_per_s, "world_size": env.world_size,
                  "weights": str(weights), "split": cfg.data.val_split, "data": data_text(cfg.data), "task": task.name}
        target = out_dir or weights.parent
        rows = named_predictions(result.predictions, loader) if predictions else None
        agree("writing the eval results", lambda: _write(report, rows, target) if env.is_main else None)
        return report
    finally:
        cluster.teardown()


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
