"""Numerics are watched (issue 25, point 4): a non-finite loss or gradient never updates the
weights; train.nonfinite=stop ends the run (exit 1) naming the step and the value, skip skips
and counts, and ends after train.nonfinite_patience in a row (also on all ranks alike); a
checkpoint of non-finite weights is never written nor best; retention keeps the last finite one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.checkpoint import layout
from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.parallel import unwrap
from hpctrain.precision import NonFiniteError, NumericsWatch
from hpctrain.train import _improved, build_components, fit, load_data, train
from tests.dist_utils import run_ranks

FLAKY = "train.loss=tests.train.test_nonfinite:flaky_loss"
BN = "model.name=tests.train.test_nonfinite:tiny_bn_mlp"
POISONED = "model.name=tests.train.test_nonfinite:poisoned_bn_mlp"
BASE = ["model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=256",
        "data.batch_size=16", "data.max_val_samples=32", "train.progress=false", "train.eval_each_epoch=false",
        "optim.name=sgd", "optim.lr=0.1", "optim.schedule=constant", "precision=fp32", "seed=3", "train.threads=1"]

# flaky_loss: the optimizer steps (1-based) whose loss is made non-finite, and how
BAD_STEPS: set[int] = set()
BAD_KIND = ["nan"]  # nan: loss and gradients nan; inf_loss: the loss alone is inf (finite gradients)
BAD_RANK: list[int | None] = [None]  # only this rank's loss is bad (None: every rank's)
_CALLS = [0]


def flaky_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, made non-finite at the steps in BAD_STEPS (one call per step: grad_accum=1)."""
    _CALLS[0] += 1
    loss = F.cross_entropy(output.float(), target)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if _CALLS[0] not in BAD_STEPS or BAD_RANK[0] not in (None, rank):
        return loss
    return loss * math.nan if BAD_KIND[0] == "nan" else loss + math.inf  # + inf: the gradients stay finite


def overflow_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss whose fp16 forward overflows (65504) at every step."""
    return (output * 1e6).float().mean() + F.cross_entropy(output.float(), target)


def _arm(steps: set[int], kind: str = "nan", rank: int | None = None) -> None:
    BAD_STEPS.clear()
    BAD_STEPS.update(steps)
    BAD_KIND[0], BAD_RANK[0], _CALLS[0] = kind, rank, 0


def _fit(env: ClusterEnv, *extra: str) -> tuple[dict, object, dict]:
    """(initial weights, fit's result or its NonFiniteError, weights after)."""
    cfg = load_config(None, [*BASE, "train.max_steps=6", *extra])
    device = torch.device("cpu")
    parts = build_components(cfg, env, device, load_data(cfg, env, device, with_val=False))
    before = {k: v.detach().clone() for k, v in unwrap(parts.model).state_dict().items()}
    try:
        outcome: object = fit(cfg, env, device, parts)
    except NonFiniteError as err:
        outcome = err
    after = {k: v.detach().clone() for k, v in unwrap(parts.model).state_dict().items()}
    return before, outcome, after


def _finite(weights: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in weights.values())


# ---------------------------------------------------------------- the policy, in the loop


def test_config_keys_are_checked() -> None:
    assert load_config(None, []).train.nonfinite == "stop"
    with pytest.raises(ConfigError, match=r"train.nonfinite='never'.*stop, skip"):
        load_config(None, ["train.nonfinite=never"])
    with pytest.raises(ConfigError, match=r"train.nonfinite_patience=0 must be > 0"):
        load_config(None, ["train.nonfinite_patience=0"])


def test_stop_ends_at_the_first_nonfinite_step_with_the_weights_of_the_step_before() -> None:
    _arm({3})
    _, err, after = _fit(ClusterEnv(), FLAKY)
    assert isinstance(err, NonFiniteError) and err.exit_code == 1
    assert str(err).startswith("step 3: the loss is nan and the largest gradient is nan;")
    assert "train.nonfinite=stop" in str(err) and "\n" not in str(err)
    _arm({99})  # the same run, stopped before step 3 by max_steps: the weights it stopped with
    _, result, two_steps = _fit(ClusterEnv(), FLAKY, "train.max_steps=2")
    assert all(torch.equal(after[k], two_steps[k]) for k in after)


def test_stop_on_a_gpu_judges_one_step_late_and_the_last_step_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, stop reads a step's values one step later (never waiting for the GPU): the same
    run stops naming the same step, its update applied; a non-finite last step is caught too."""
    import hpctrain.train as trainer
    from hpctrain.precision import LateRead

    monkeypatch.setattr(trainer, "_late_read", lambda loop: LateRead(cuda=False))  # the GPU's path, on the CPU
    _arm({3})
    _, err, _ = _fit(ClusterEnv(), FLAKY)
    assert isinstance(err, NonFiniteError)
    assert str(err).startswith("step 3: the loss is nan and the largest gradient is nan;")
    assert "the weights are those after step 3, read one step late on the GPU" in str(err)
    assert _CALLS[0] == 4  # step 4's forward ran before step 3 was judged
    _arm({6})
    _, err, _ = _fit(ClusterEnv(), FLAKY)  # train.max_steps=6
    assert isinstance(err, NonFiniteError) and str(err).startswith("step 6: the loss is nan")


def test_skip_keeps_the_weights_finite_and_counts_the_steps() -> None:
    _arm({2, 3, 5})  # nan from the forward, before a BatchNorm: a skipped step must not leave its statistics nan
    before, result, after = _fit(ClusterEnv(), "train.nonfinite=skip", POISONED)
    assert not isinstance(result, NonFiniteError)
    assert _finite(after) and any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    assert result.numerics == {"nonfinite_steps": 3, "nonfinite_skipped_steps": 3, "first_nonfinite_step": 2,
                               "scaler_skipped_steps": 0}


def test_skip_stops_after_patience_in_a_row() -> None:
    _arm({2, 3, 4})
    _, err, after = _fit(ClusterEnv(), FLAKY, "train.nonfinite=skip", "train.nonfinite_patience=3")
    assert isinstance(err, NonFiniteError) and _finite(after)
    assert str(err).startswith("step 4: the loss is nan")
    assert "3 non-finite steps in a row (train.nonfinite_patience=3; 2 skipped in all, the first at step 2)" in str(err)


def test_a_finite_run_reports_zero_in_the_summary(tmp_path: Path) -> None:
    summary = train(load_config(None, [*BASE, "train.max_steps=2", f"run.dir={tmp_path / 'run'}",
                                       "checkpoint.enabled=false"]))
    assert (summary["nonfinite_steps"], summary["nonfinite_skipped_steps"]) == (0, 0)
    assert summary["first_nonfinite_step"] is None and summary["scaler_skipped_steps"] == 0


def test_fp16_overflow_stops_after_patience_with_the_weights_unchanged() -> None:
    """Every step's fp16 forward overflows: skipped (the weights stay the initial ones), then stopped."""
    before, err, after = _fit(ClusterEnv(), "precision=fp16", "train.loss=tests.train.test_nonfinite:overflow_loss",
                              "train.nonfinite=skip", "train.nonfinite_patience=2")
    assert isinstance(err, NonFiniteError)
    assert str(err).startswith("step 2: the loss is nan")
    assert "precision=fp16, loss scale 65536" in str(err) and "hint: precision=bf16" in str(err)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_fp16_scaler_backoff_is_not_nonfinite_but_overflow_at_scale_one_is() -> None:
    watch = NumericsWatch("stop", 3)
    assert watch.judge(1, 2.3, math.inf, scale=65536.0)  # the scaler skips it and halves its scale
    assert watch.judge(2, 2.3, 0.5, scale=32768.0)
    assert watch.summary()["scaler_skipped_steps"] == 1 and watch.nonfinite_steps == 0
    with pytest.raises(NonFiniteError, match=r"^step 3: the largest gradient is inf .*loss scale 1\b"):
        watch.judge(3, 2.3, math.inf, scale=1.0)  # overflows unscaled: the scaler cannot help


def test_lr_1e6_exits_1_naming_the_step_and_the_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's reproduction (optim.lr=1e6 trained on nan and exited 0): exit 1, one line."""
    from hpctrain.cli import main as cli_main

    run = tmp_path / "run"
    code = cli_main(["train", *BASE, BN, "optim.lr=1e6", "train.max_steps=16", f"run.dir={run}",
                     "checkpoint.every_steps=1", "checkpoint.keep_last=3"])
    err = capsys.readouterr().err
    assert code == 1, err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in err
    assert "step 5: the loss is nan" in errors[0] and "train.nonfinite=stop" in errors[0]
    assert json.loads((run / "status.json").read_text())["outcome"] == "failed"
    steps = [s for s, _ in layout.committed(run / "checkpoints")]
    assert steps == [2, 3, 4]  # the newest before the non-finite step, all finite (none of step 5 or later)


# ---------------------------------------------------------------- every rank alike


def _two_ranks(env: ClusterEnv, kind: str) -> str:
    _arm({3}, kind, rank=1)
    _, err, after = _fit(env, FLAKY)
    assert _finite(after)
    return str(err)


def test_two_ranks_stop_together_when_one_rank_alone_sees_it() -> None:
    """Rank 1's loss alone is inf (its gradients finite: DDP's all-reduce cannot spread it):
    both ranks stop at the same step with the same message, and neither hangs."""
    messages = run_ranks(2, _two_ranks, "inf_loss")
    assert messages[0] == messages[1]
    assert messages[0].startswith("step 3: the loss is inf;")


# ---------------------------------------------------------------- checkpoints, best, retention


def test_nonfinite_weights_are_never_saved_nor_best(tmp_path: Path) -> None:
    from hpctrain.checkpoint.checkpointer import Checkpointer
    from tests.ckpt_models import make_parts

    parts = make_parts()
    cfg = load_config(None, ["checkpoint.keep_last=1", "checkpoint.on_best=true"])
    ckpt = Checkpointer(tmp_path, ClusterEnv(), torch.device("cpu"), cfg.checkpoint, parts.state())
    ckpt.save({})
    first = layout.committed(ckpt.root)
    assert len(first) == 1 and layout.read_manifest(first[0][1])["finite"] is True
    with torch.no_grad():
        next(parts.model.parameters()).view(-1)[0] = math.nan
    parts.counters.step += 1
    best = {"metric": "val_loss", "value": 0.5, "step": parts.counters.step}
    ckpt.note_best(best)  # on_best: saves, but not these weights
    ckpt.save(best, blocking=True)
    ckpt.close()
    assert layout.committed(ckpt.root) == first  # nothing written, nothing marked, the finite one kept
    assert not (ckpt.root / layout.BEST_FILE).exists()


def test_a_nan_validation_is_never_the_best() -> None:
    cfg = load_config(None, [])
    assert not _improved(cfg, "val_loss", {"val_loss": math.nan}, {})
    assert not _improved(cfg, "val_accuracy", {"val_accuracy": math.nan}, {})
    assert not _improved(cfg, "val_accuracy", {"val_accuracy": 0.11, "val_loss": math.nan}, {})  # a broken model
    assert _improved(cfg, "val_loss", {"val_loss": 2.0}, {"metric": "val_loss", "value": math.nan, "step": 6})


def _commit(root: Path, step: int, finite: bool | None) -> None:
    partial = root / f".partial-{step}"
    partial.mkdir(parents=True)
    (partial / "x.bin").write_bytes(b"x")
    info = {"step": step} if finite is None else {"step": step, "finite": finite}
    layout.commit(partial, root / layout.step_name(step), {"x.bin": layout.hash_file(partial / "x.bin")}, info)


def test_retention_keeps_the_last_finite_checkpoint(tmp_path: Path) -> None:
    """Steps 3-5 as an older version wrote them (nan, unmarked) and a nan best: keep_last=2 keeps
    step 2, the newest checkpoint known finite; best.json's nan value protects nothing."""
    root = tmp_path / "checkpoints"
    for step, finite in ((1, True), (2, True), (3, None), (4, None), (5, None)):
        _commit(root, step, finite)
    (root / layout.BEST_FILE).write_text(json.dumps({"metric": "val_loss", "value": math.nan, "step": 1}))
    assert layout.best_step(root) is None
    layout.apply_retention(root, keep_last=2, keep_every=None)
    assert [s for s, _ in layout.committed(root)] == [2, 4, 5]


def tiny_bn_mlp(num_classes: int = 10) -> nn.Module:
    """tiny_mlp with a BatchNorm, like the default model: optim.lr=1e6 makes its loss nan within a few steps."""
    return nn.Sequential(nn.Linear(128, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, num_classes))


class _Poison(nn.Module):
    """nan into the activations at the training forwards (= steps) in BAD_STEPS."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or x.is_meta:  # validation, or the FLOP count's forward
            return x
        _CALLS[0] += 1
        return x * math.nan if _CALLS[0] in BAD_STEPS else x


def poisoned_bn_mlp(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(128, 32), _Poison(), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, num_classes))
