"""Every registered model, and a user's own factory, under every strategy that applies to it:
2 gloo ranks, 2 optimizer steps each through ``hpctrain.train.train``, exact validation counted.
(``parallel.strategy=fsdp`` crashed on the default mnist_cnn once, and no test ran it: this
matrix is the test that would have caught it.) One spawned pair of ranks per strategy runs all
its models in turn, in the process group the ranks already hold."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config import load_config
from hpctrain.env import ClusterEnv
from hpctrain.models import REGISTRY
from tests.dist_utils import run_ranks
from tests.data.test_text import needs_sdist

COMMON = ["train.max_steps=2", "train.progress=false", "train.threads=1", "checkpoint.every_seconds=None",
          "data.batch_size=4", "data.eval_batch_size=8", "data.max_val_samples=21", "checkpoint.enabled=false",
          "optim.schedule=constant", "telemetry.straggler_every_steps=0"]
# each model with data of its input shape (image models on synthetic data: no download, no decode)
DATA = {
    "mnist_cnn": ["data.name=mnist", "data.max_train_samples=64"],
    "simple_cnn": ["data.name=synthetic_cifar", "data.synthetic_size=128"],
    "resnet18": ["data.name=synthetic_cifar", "data.synthetic_size=128"],
    "gpt": ["data.name=shards", "data.path={shards}", "model.n_layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=32",
            "model.tie_weights=false", "optim.name=adamw", "optim.lr=0.01"],
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


def _train_each(env: ClusterEnv, cases: list[tuple[str, list[str]]], root: str) -> dict[str, dict[str, Any]]:
    from hpctrain.train import train

    out = {}
    for name, keys in cases:
        summary = train(load_config(None, [*keys, f"run.dir={root}/{name}"]), env)
        out[name] = {k: summary[k] for k in ("steps", "val_count", "val_loss", "world_size", "params_sha256")}
    return out


@needs_sdist
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_model_under(strategy: str, tmp_path: Path, shakespeare_shards: Path) -> None:
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    keys, gpt_only = STRATEGIES[strategy]
    models = ["gpt"] if gpt_only else MODELS
    cases = [(model.replace(":", "-"), [*COMMON, *(key.format(shards=shakespeare_shards) for key in DATA[model]),
                                        *keys, f"model.name={model}"]) for model in models]
    results = run_ranks(2, _train_each, cases, str(tmp_path), timeout=600)
    for name, _ in cases:
        got = results[0][name]
        assert got["steps"] == 2 and got["world_size"] == 2, (strategy, name, got)
        assert got["val_count"] == 21, (strategy, name, got)  # every validation sample once
        assert math.isfinite(got["val_loss"]), (strategy, name, got)
        assert results[1][name] == got  # every rank reports the same, merged numbers


@needs_sdist
def test_cpu_offload_trains_to_fsdp_s_weights(tmp_path: Path, shakespeare_shards: Path) -> None:
    """parallel.cpu_offload=true (strategy fsdp_offload: one file, parallel/fsdp_offload.py) keeps the
    shards in host memory and steps the optimizer there: the same arithmetic as fsdp, the same weights."""
    base = [*COMMON, *(key.format(shards=shakespeare_shards) for key in DATA["gpt"]), "model.name=gpt",
            "parallel.strategy=fsdp", "train.max_steps=3"]
    results = run_ranks(2, _train_each, [("fsdp", base), ("offload", [*base, "parallel.cpu_offload=true"])],
                        str(tmp_path), timeout=600)
    assert results[0]["offload"]["params_sha256"] == results[0]["fsdp"]["params_sha256"]
    assert results[0]["offload"]["val_loss"] == results[0]["fsdp"]["val_loss"]
