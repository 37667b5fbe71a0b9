"""``hpctrain eval``: validation only, from saved weights, at any world size."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from hpctrain import env as cluster
from hpctrain.config import Config
from hpctrain.data import build_val_loader
from hpctrain.errors import UserError
from hpctrain.evaluate import evaluate, write_predictions
from hpctrain.metrics import default_metrics
from hpctrain.models import build_model
from hpctrain.precision import Precision
from hpctrain.rundir import write_json

log = logging.getLogger("hpctrain")


class WeightsError(UserError):
    """The weights file is missing or does not fit the model."""


def load_weights(model: torch.nn.Module, path: Path) -> None:
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist; hint: a run writes RUN_DIR/model.pt")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise WeightsError(f"weights {path} do not fit model: {str(err).splitlines()[0]}") from err


def run_eval(cfg: Config, weights: Path, out_dir: Path | None = None, predictions: bool = False) -> dict[str, Any]:
    env = cluster.detect()
    device = cluster.init_distributed(env, cfg.parallel.backend, cfg.parallel.init_timeout_s)
    try:
        loader, data_classes, input_shape = build_val_loader(cfg, env)
        num_classes = cfg.model.num_classes or data_classes
        model = build_model(cfg.model.name, num_classes, input_shape[0])
        load_weights(model, weights)
        result = evaluate(model.to(device), loader, default_metrics(num_classes), env, device,
                          Precision(cfg.precision, device), collect_predictions=predictions)
        report = {**result.metrics, "samples_per_s": result.samples_per_s, "world_size": env.world_size,
                  "weights": str(weights), "split": cfg.data.val_split, "data": cfg.data.name}
        target = out_dir or weights.parent
        if env.is_main:
            target.mkdir(parents=True, exist_ok=True)
            write_json(target / "eval.json", report)
            if predictions:
                write_predictions(result.predictions, target / "predictions.jsonl")
            log.info("eval: count %d  correct %d  accuracy %.4f  loss %.4f -> %s", report["count"],
                     report["correct"], report["accuracy"], report["loss"], target / "eval.json")
        return report
    finally:
        cluster.teardown()
