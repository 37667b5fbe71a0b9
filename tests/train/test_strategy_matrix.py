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
import torch

from hpctrain.estimate import gpu_memory as memory
from hpctrain.models import REGISTRY
from hpctrain.models.llama import Llama, LlamaShape
from hpctrain.models.shape import stage_params
from hpctrain.weights.digest import params_sha256
from tests.data.test_text import needs_sdist
from tests.dist_utils import train_cases

pytestmark = pytest.mark.slow  # launches or several ranks: scheduled first (tests/conftest.py)

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
    # 3 blocks: pp2 runs uneven stages (1 + 2); 2 key/value heads for 4 query heads (grouped-query)
    "llama": ["data.name=shards", "data.path={shards}", "model.n_layers=3", "model.hidden=32", "model.heads=4",
              "model.kv_heads=2", "model.seq_len=32", "model.tie_weights=false", "optim.name=adamw", "optim.lr=0.01"],
    "tests.user_models:tiny_mlp": ["data.name=synthetic_tiny", "data.synthetic_size=128"],
}
# strategy -> keys; "blocks_only": the model must have a plan for its blocks (tensor / pipeline parallel)
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
SPLIT_MODELS = ["gpt", "llama"]  # the registered models tensor and pipeline parallelism can cut
LLAMA_SHAPE = LlamaShape(vocab=256, seq_len=32, n_layers=3, hidden=32, heads=4, kv_heads=2, tie_weights=False)
STEP1 = Path("checkpoints") / "step-000000001"


def test_the_matrix_covers_every_registered_model() -> None:
    assert set(REGISTRY) <= set(DATA), f"add data for the new model(s): {set(REGISTRY) - set(DATA)}"


def _cases(shards: Path, root: Path) -> list[tuple[str, list[str]]]:
    cases = []
    for strategy, (keys, blocks_only) in STRATEGIES.items():
        if strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            continue
        for model in SPLIT_MODELS if blocks_only else MODELS:
            data = [key.format(shards=shards) for key in DATA[model]]
            cases.append((f"{strategy}-{model.replace(':', '-')}", [*COMMON, *data, *keys, f"model.name={model}"]))
    return cases + _llama_cases(shards, root)


def _llama_cases(shards: Path, root: Path) -> list[tuple[str, list[str]]]:
    """The llama beyond the matrix: tied, at tp2 plain and with sequence parallel + meta init +
    activation checkpointing (the same arithmetic); a tp2 checkpoint resumed (DCP, the
    vocabulary-parallel ends included) and its exported model.pt."""
    llama = [*COMMON, *(key.format(shards=shards) for key in DATA["llama"]), "model.name=llama",
             "parallel.strategy=fsdp", "parallel.tp=2"]
    tied = [*llama, "model.tie_weights=true"]
    saving = [*llama, "checkpoint.enabled=true", "checkpoint.every_steps=1"]
    return [("llama-tied-tp2", tied),
            ("llama-tied-tp2-sp-meta-ac", [*tied, "parallel.sequence_parallel=true", "parallel.meta_init=true",
                                           "parallel.activation_checkpointing=block"]),
            ("llama-tp2-saved", saving),
            ("llama-tp2-resumed", [*saving, f"resume={root / 'llama-tp2-saved' / STEP1}"])]


@pytest.fixture(scope="module")
def matrix_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("matrix")


@pytest.fixture(scope="module")
def matrix(shakespeare_shards: Path, matrix_root: Path) -> list[dict[str, Any]]:
    """All cases in one spawned pair of ranks (one torch import and one process group for all)."""
    return train_cases(2, _cases(shakespeare_shards, matrix_root), matrix_root,
                       keep=("steps", "val_count", "val_loss", "world_size", "params_sha256", "memory_breakdown"))


@needs_sdist
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_model_under(strategy: str, matrix: list[dict[str, Any]]) -> None:
    if strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:  # the ranks import it, not pytest
        pytest.skip("the deepspeed extra is not installed")
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
    shards in host memory and steps the optimizer there: the same arithmetic as fsdp, the same weights,
    for every model of the matrix."""
    for model in MODELS:
        name = model.replace(":", "-")
        fsdp, offload = matrix[0][f"fsdp-{name}"], matrix[0][f"fsdp_offload-{name}"]
        assert isinstance(fsdp, dict) and isinstance(offload, dict), (fsdp, offload)
        assert offload["params_sha256"] == fsdp["params_sha256"] and offload["val_loss"] == fsdp["val_loss"], model


def _ok(matrix: list[dict[str, Any]], name: str) -> dict[str, Any]:
    got = matrix[0][name]
    assert isinstance(got, dict), f"{name}: {got}"
    return got


# matrix case -> (estimator strategy, dp, tp, pp): tp2 and pp2 run fsdp at dp=1 (nothing to shard over)
LAYOUTS = {"ddp": ("ddp", 2, 1, 1), "fsdp": ("fsdp", 2, 1, 1), "tp2": ("fsdp", 1, 2, 1), "pp2": ("fsdp", 1, 1, 2)}


@needs_sdist
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_llama_memory_per_rank_is_the_estimators(case: str, matrix: list[dict[str, Any]]) -> None:
    """Each rank's measured parameters, gradients and optimizer state (summary.json's
    memory_breakdown: the bytes of the tensors it holds) against ``hpctrain estimate``'s for the
    same shape, fp32 + Adam (4 + 4 + 8 bytes a parameter): ddp replicates, fsdp shards over dp,
    tp2 halves every matrix (the llama's plan splits the embedding and output by vocabulary
    too; only the norms stay whole), pp2 holds its stage's blocks (uneven: 1 + 2) and end.
    Activations are not compared: see docs/models.md."""
    strategy, dp, tp, pp = LAYOUTS[case]
    held = stage_params(LLAMA_SHAPE.transformer(), pp)
    rows = _ok(matrix, f"{case}-llama")["memory_breakdown"]
    assert len(rows) == 2
    for row in rows:
        est = memory.per_rank(held[row["rank"] // (dp * tp)], strategy, dp=dp, tp=tp, layout=memory.FP32)
        for part, want in (("params", est.weights), ("grads", est.grads), ("optimizer", est.optimizer)):
            # equal to within the norms, the step counters and (tp2 gradients, +8%) the
            # embedding's gradient, which the trainer's step holds replicated (docs/models.md)
            assert row[f"{part}_bytes"] == pytest.approx(want, rel=0.15), (case, row, part, want)


@needs_sdist
def test_llama_tp2_sequence_parallel_meta_init_and_checkpointing_keep_the_arithmetic(
        matrix: list[dict[str, Any]]) -> None:
    """Tied llama at tp2 (the vocabulary-sharded embedding and head share one weight): with
    sequence parallel, meta-device init and block activation checkpointing on top it trains to
    the same loss (summation order only)."""
    plain, rest = _ok(matrix, "llama-tied-tp2"), _ok(matrix, "llama-tied-tp2-sp-meta-ac")
    assert plain["steps"] == rest["steps"] == 2 and plain["val_count"] == rest["val_count"] == 21
    assert abs(plain["val_loss"] - rest["val_loss"]) < 1e-5


@needs_sdist
def test_llama_tp2_checkpoint_resumes_bitwise_and_exports_the_whole_model(matrix: list[dict[str, Any]],
                                                                          matrix_root: Path) -> None:
    saved, resumed = _ok(matrix, "llama-tp2-saved"), _ok(matrix, "llama-tp2-resumed")
    assert resumed["params_sha256"] == saved["params_sha256"] and resumed["val_loss"] == saved["val_loss"]
    model = Llama(LLAMA_SHAPE)  # model.pt: the whole model, gathered from the tp shards
    model.load_state_dict(torch.load(matrix_root / "llama-tp2-saved" / "model.pt", weights_only=True))
    assert params_sha256(model) == saved["params_sha256"]
