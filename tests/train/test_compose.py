"""``parallel.activation_checkpointing`` (block, selective) and ``train.compile`` composed with
ddp, fsdp and zero1 through the trainer (one forked pair of ranks runs every case in turn), in
the documented order (TP -> activation checkpointing -> compile -> FSDP / DDP): 3 steps of the
tiny GPT at world 2 give the losses of one plain process within 1e-5 (1e-4 with compile:
inductor's fused kernels may round differently), and the summary's params_sha256 is the hash
of the weights in model.pt whatever wrappers the run used. Activation checkpointing recomputes
the same ops, so alone it changes no bit: one process with block or selective ends with the
plain run's exact weights, and so do zero1's two modes with each other."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.config import load_config
from hpctrain.models.gpt import GPT, GPTShape
from hpctrain.train import train
from hpctrain.weights.digest import params_sha256
from tests.checkpoint.test_export_stream import corpus_shards
from tests.dist_utils import train_cases
from tests.gpt_runs import step_losses

TOL, COMPILED_TOL = 1e-5, 1e-4
BASE = ["model.name=gpt", "model.n_layers=1", "model.hidden=32", "model.heads=4", "model.seq_len=16",
        "data.name=shards", "data.batch_size=4", "data.global_batch_size=8", "data.max_val_samples=8",
        "train.max_steps=3", "train.log_every=1", "train.progress=false", "train.threads=1", "optim.name=adamw",
        "optim.lr=0.01", "checkpoint.enabled=false"]
# one block (a compiled case compiles the whole graph, ~2x the CPU at two); the pipeline's two stages
# need two blocks and cannot share the embedding with the head
UNTIED = ["model.tie_weights=false", "model.n_layers=2"]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# (id, the strategy's keys, activation checkpointing, compile): every strategy of the loop, in the
# documented order tp -> activation checkpointing -> compile -> FSDP / DDP / pipeline stages
CASES = [("ddp", ["parallel.strategy=ddp"], "block", False), ("ddp", ["parallel.strategy=ddp"], "selective", True),
         ("fsdp", ["parallel.strategy=fsdp"], "selective", False), ("fsdp", ["parallel.strategy=fsdp"], "block", True),
         ("zero1", ["parallel.strategy=zero1"], "block", False),
         ("zero1", ["parallel.strategy=zero1"], "selective", False),
         ("tp2", ["parallel.tp=2"], "selective", False), ("tp2", ["parallel.tp=2"], "none", True),
         ("pp2", ["parallel.pp=2", "parallel.microbatches=2", *UNTIED], "block", False),
         ("deepspeed", ["parallel.strategy=deepspeed"], "block", False)]


def _marks(name: str, compiled: bool) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.slow] if compiled else []
    if name == "deepspeed":
        marks.append(pytest.mark.skipif(not HAS_DEEPSPEED, reason="the deepspeed extra is not installed"))
    return marks


# compile: ~1 min per case here with inductor's cache warm, a few more cold (CPU codegen)
PARAMS = [pytest.param(name, keys, m, c, id=f"{name}-{m}{'-compile' if c else ''}", marks=_marks(name, c))
          for name, keys, m, c in CASES]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return corpus_shards(tmp_path_factory.mktemp("corpus"))


def _plain(shards: Path, run: Path, *extra: str) -> dict[str, Any]:
    summary = train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={run}", *extra]))
    return {"losses": step_losses(run), "sha": summary["params_sha256"], "val_loss": summary["val_loss"]}


@pytest.fixture(scope="module")
def plain(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _plain(shards, tmp_path_factory.mktemp("plain") / "run")


@pytest.fixture(scope="module")
def plain_untied(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _plain(shards, tmp_path_factory.mktemp("plain_untied") / "run", *UNTIED)


def _model_pt_sha(run: Path, tied: bool = True) -> str:
    model = GPT(GPTShape(vocab=256, seq_len=16, n_layers=1 if tied else 2, hidden=32, heads=4, tie_weights=tied))
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    return params_sha256(model)


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_checkpointing_in_one_process_changes_no_bit(shards: Path, plain: dict[str, Any], tmp_path: Path,
                                                     mode: str) -> None:
    run = tmp_path / "run"
    summary = train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={run}",
                                       f"parallel.activation_checkpointing={mode}"]))
    assert step_losses(run) == plain["losses"] and summary["params_sha256"] == plain["sha"] == _model_pt_sha(run)


def _case_name(name: str, mode: str, compiled: bool) -> str:
    return f"{name}-{mode}{'-compile' if compiled else ''}"


@pytest.fixture(scope="module")
def two_ranks(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Every case of CASES on one forked pair of ranks, in turn (the launcher itself is tested
    in tests/launch and tests/train/test_e2e.py)."""
    root = tmp_path_factory.mktemp("compose")
    cases = [(_case_name(name, m, c), [*BASE, f"data.path={shards}", *keys, f"parallel.activation_checkpointing={m}",
                                       f"train.compile={str(c).lower()}"])
             for name, keys, m, c in CASES if name != "deepspeed" or HAS_DEEPSPEED]
    return root, train_cases(2, cases, root, keep=("val_loss", "params_sha256"))


@pytest.mark.parametrize(("name", "keys", "mode", "compiled"), PARAMS)
def test_two_ranks_compose_with_checkpointing_and_compile(two_ranks: tuple[Path, list[dict[str, Any]]],
                                                          request: pytest.FixtureRequest, name: str,
                                                          keys: list[str], mode: str, compiled: bool) -> None:
    tied = not set(UNTIED) <= set(keys)
    plain: dict[str, Any] = request.getfixturevalue("plain" if tied else "plain_untied")
    root, ranks = two_ranks
    case = _case_name(name, mode, compiled)
    summary, run = ranks[0][case], root / case
    assert isinstance(summary, dict), f"{case}: {summary}"
    assert ranks[1][case] == summary  # both ranks report the same, merged numbers
    got, want, tol = step_losses(run), plain["losses"], COMPILED_TOL if compiled else TOL
    assert got.keys() == want.keys() and len(want) == 3
    assert max(abs(got[s] - want[s]) for s in want) < tol, (got, want)
    assert abs(summary["val_loss"] - plain["val_loss"]) < tol
    assert summary["params_sha256"] == _model_pt_sha(run, tied)  # the wrappers' names never reach the hash
    if name == "zero1":  # block and selective give the same bits
        other = ranks[0][_case_name(name, "selective" if mode == "block" else "block", False)]
        assert other["params_sha256"] == summary["params_sha256"]
