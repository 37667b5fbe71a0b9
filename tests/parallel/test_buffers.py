"""Buffers are state, kept in step: a BatchNorm CNN at 2 gloo ranks under every strategy that runs
on CPU (ddp, zero1, fsdp, hsdp, fsdp with offload, DeepSpeed ZeRO-2/3 when installed). The last
logged ``val_loss`` equals ``hpctrain eval`` of ``model.pt`` exactly (every rank validates with
rank 0's running statistics, which model.pt holds); a resume from a checkpoint, and a SIGKILL
then the same command, end bit-identical including buffers (``buffers_sha256``); padding
samples never reach BatchNorm; ``parallel.sync_batchnorm=true`` is refused on CPU (exit 2)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hpctrain.checkpoint import layout
from hpctrain.core.env import ClusterEnv
from hpctrain.weights.digest import ParamsHash
from tests.checkpoint import test_preempt as preempt
from tests.dist_utils import run_ranks


class TinyBN(nn.Module):
    """128 features as a 2 x 8 x 8 image -> Conv -> BatchNorm2d -> ReLU -> Linear: 27 is not the
    point, one BatchNorm (running mean, var, count) is. ``sleep``: seconds per training forward."""

    def __init__(self, num_classes: int = 10, sleep: float = 0.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 8 * 8, num_classes)
        self.sleep = sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.sleep:
            time.sleep(self.sleep)
        return self.head(self.bn(self.conv(x.view(-1, 2, 8, 8))).relu().flatten(1))


def tiny_bn(num_classes: int = 10) -> nn.Module:
    return TinyBN(num_classes)


def slow_bn(num_classes: int = 10) -> nn.Module:
    """tiny_bn (the same weights and results) whose training steps take >= 0.3 s: a SIGKILL lands mid-run."""
    return TinyBN(num_classes, sleep=0.3)


pytestmark = pytest.mark.slow  # launches or several ranks: scheduled first (tests/conftest.py)
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STEP3 = Path("checkpoints") / layout.step_name(3)
BASE = ["model.name=tests.parallel.test_buffers:tiny_bn", "data.name=synthetic_tiny", "data.synthetic_size=256",
        "data.batch_size=8", "data.max_val_samples=50", "data.eval_batch_size=8", "train.max_steps=6",
        "train.eval_every_steps=3", "train.log_every=1", "train.progress=false", "train.threads=1",
        "optim.lr=0.05", "checkpoint.every_steps=3", "checkpoint.every_seconds=None",
        "telemetry.straggler_every_steps=0"]
STRATEGIES: dict[str, list[str]] = {
    "ddp": ["parallel.strategy=ddp"],
    "zero1": ["parallel.strategy=zero1"],
    "fsdp": ["parallel.strategy=fsdp"],
    "hsdp": ["parallel.strategy=hsdp", "parallel.dp_replicate=2"],
    "fsdp_offload": ["parallel.strategy=fsdp", "parallel.cpu_offload=true"],
}
if HAS_DEEPSPEED:
    STRATEGIES |= {f"deepspeed{s}": ["parallel.strategy=deepspeed", f"parallel.deepspeed_stage={s}"] for s in (2, 3)}


def _sync_check(env: ClusterEnv) -> tuple[int, list[float]]:
    """Each rank's buffers made its rank number + 1, then synced: rank 0's everywhere."""
    from hpctrain.core.modules import sync_buffers

    model = TinyBN()
    for buf in model.buffers():
        buf.fill_(env.rank + 1)
    count = sync_buffers(model)
    return count, [float(b.float().mean()) for b in model.buffers()]


def _eval_weights(cfg: Any, env: ClusterEnv, weights: Path) -> float:
    """What `hpctrain eval --weights` computes (hpctrain.evaluation.job.run_eval), in the running
    group: run_eval itself ends the process group it finds started by init_distributed."""
    from hpctrain.evaluation.evaluate import evaluate
    from hpctrain.evaluation.job import _prepare
    from hpctrain.precision import Precision

    loader, num_classes, model, task = _prepare(cfg, env, weights)
    device = torch.device("cpu")
    result = evaluate(model, loader, task.metrics(num_classes), env, device, Precision(cfg.precision, device),
                      task=task)
    return float(result.metrics["loss"])


def _train_and_eval(env: ClusterEnv, root: str) -> dict[str, Any]:
    """Every strategy's run, its resume from the step-3 checkpoint and `hpctrain eval` of its
    model.pt at world 2, in one process group (one torch import for all)."""
    from hpctrain.config import load_config
    from hpctrain.train import train

    out: dict[str, Any] = {"synced": _sync_check(env)}
    keep = ("val_loss", "params_sha256", "buffers_sha256", "steps")
    for name, keys in STRATEGIES.items():
        run = f"{root}/{name}"
        cfg = load_config(None, [*BASE, *keys, f"run.dir={run}"])
        # the barriers: a rank still checking a new run.dir must not see rank 0 already creating it
        torch.distributed.barrier()
        summary = train(cfg, env)
        torch.distributed.barrier()
        resumed = train(load_config(None, [*BASE, *keys, f"run.dir={run}-resumed", f"resume={run}/{STEP3}"]), env)
        out[name] = {"run": {k: summary[k] for k in keep}, "resumed": {k: resumed[k] for k in keep},
                     "eval_loss": _eval_weights(cfg, env, Path(run) / "model.pt")}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("buffers")
    return root, run_ranks(2, _train_and_eval, str(root), timeout=600)


def _logged_val_losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["val_loss"] for row in rows if "val_loss" in row]


def _buffers_sha256(path: Path) -> str:
    """The buffers of a model.pt, hashed as summary.json's buffers_sha256 is."""
    state = torch.load(path, weights_only=True)
    names = [f"bn.{k}" for k in ("num_batches_tracked", "running_mean", "running_var")]
    digest = ParamsHash(names)
    for name in sorted(names):
        digest.update(name, state[name])
    return digest.hexdigest()


def test_sync_buffers_sets_every_rank_to_rank_0s(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = runs
    assert ranks[0]["synced"] == ranks[1]["synced"] == (3, [1.0, 1.0, 1.0])


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_logged_validation_is_the_saved_models(runs: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    root, ranks = runs
    got = ranks[0][name]
    logged = _logged_val_losses(root / name)
    assert len(logged) == 2  # steps 3 and 6
    assert logged[-1] == got["run"]["val_loss"] == got["eval_loss"]  # exactly, not within a tolerance
    assert ranks[1][name]["eval_loss"] == got["eval_loss"]
    assert got["run"]["buffers_sha256"] == _buffers_sha256(root / name / "model.pt")
    assert ranks[1][name]["run"] == got["run"]  # every rank reports rank 0's digests


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_resume_is_bit_identical_including_buffers(runs: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    _, ranks = runs
    got = ranks[0][name]
    assert got["resumed"]["steps"] == got["run"]["steps"] == 6
    assert got["resumed"] == got["run"]  # params, buffers and the validation after the resume


def test_every_strategy_keeps_rank_0s_statistics(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    """Broadcast from rank 0 never changes rank 0's buffers, so every strategy ends with the same
    running statistics (ddp's are rank 0's own, as are fsdp's and DeepSpeed's)."""
    _, ranks = runs
    digests = {ranks[0][name]["run"]["buffers_sha256"] for name in STRATEGIES}
    assert len(digests) == 1, digests


def test_fsdp_sigkill_then_the_same_command_is_bit_identical(runs: tuple[Path, list[dict[str, Any]]],
                                                            tmp_path: Path) -> None:
    """SIGKILL to both FSDP ranks and the launcher after a committed checkpoint, then the same
    command: params, buffers (DCP once wrote each replicated buffer from either rank) and the
    logged validation equal the uninterrupted run's."""
    root, ranks = runs
    reference = ranks[0]["fsdp"]["run"]
    run_dir = tmp_path / "run"
    keys = [k.replace(":tiny_bn", ":slow_bn") for k in BASE]
    cmd = [sys.executable, "-m", "hpctrain", "run", "-n", "2", "train", *keys, *STRATEGIES["fsdp"],
           f"run.dir={run_dir}"]
    proc = preempt._start(cmd)
    preempt._wait_for_step(run_dir, 4, proc)  # the step-3 checkpoint (a sync save) is committed
    for pid in [*preempt._workers(proc.pid), proc.pid]:
        os.kill(pid, signal.SIGKILL)
    proc.communicate()
    assert not (run_dir / "summary.json").exists()
    assert [step for step, _ in layout.committed(run_dir / "checkpoints")] == [3]
    code, out = preempt._run(cmd)
    assert code == 0, out[-3000:]
    assert "resumed from" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {k: summary[k] for k in reference} == reference
    assert _logged_val_losses(run_dir)[-1] == _logged_val_losses(root / "fsdp")[-1]


# ---------------------------------------------------------------- padding, SyncBatchNorm


def _strategy() -> Any:
    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.parallel import strategy_for
    from hpctrain.tasks import Classification

    strategy = strategy_for(ParallelConfig(), ClusterEnv(), torch.device("cpu"))
    strategy.setup(tiny_bn, loss_fn=Classification().loss,
                   make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0),
                   make_scheduler=lambda o: None)
    return strategy


def test_padding_samples_never_reach_batchnorm() -> None:
    strategy = _strategy()
    bn = strategy.inner.bn
    inputs = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    targets, mask = torch.tensor([1, 2, 3, 4]), torch.tensor([True, True, False, False])
    with torch.no_grad():
        want = TinyBN()
        want.load_state_dict(strategy.inner.state_dict())
        want.train()(inputs[:2])  # the real samples alone
    loss = strategy.micro_step(inputs, targets, mask, sync=True, accum=1)
    assert torch.isfinite(loss)
    assert torch.equal(bn.running_mean, want.bn.running_mean) and torch.equal(bn.running_var, want.bn.running_var)
    before = {k: v.clone() for k, v in bn.state_dict().items() if "running" in k}
    loss = strategy.micro_step(inputs, targets, torch.zeros(4, dtype=torch.bool), sync=True, accum=1)
    assert float(loss) == 0.0  # all padding: a forward still runs (collectives stay in step), counting nothing
    assert all(torch.equal(bn.state_dict()[k], v) for k, v in before.items())


def test_sync_batchnorm_is_refused_where_the_backend_cannot(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    from hpctrain.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: SyncBatchNorm runs")
    code = main(["train", *BASE, "parallel.sync_batchnorm=true", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "parallel.sync_batchnorm=true needs CUDA GPUs with the NCCL backend" in err
    assert not (tmp_path / "run").exists()


def test_sync_batchnorm_converts_every_batchnorm() -> None:
    from hpctrain.parallel.buffers import convert_sync_batchnorm

    model = convert_sync_batchnorm(TinyBN(), None)
    assert isinstance(model.bn, nn.SyncBatchNorm) and not any(type(m) is nn.BatchNorm2d for m in model.modules())
