"""A finished run asked for more steps goes on from its last checkpoint (issue 24, point 5), at
the same or another world size; the config-change message names only what changed (point 6)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hpctrain.checkpoint import layout
from hpctrain.checkpoint.state import config_changes
from hpctrain.config import load_config, to_dict
from hpctrain.core.rundir import RunDirError
from hpctrain.train import train
from tests.dist_utils import train_cases

BASE = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=256",
        "data.global_batch_size=16", "data.max_val_samples=32", "train.epochs=3", "train.log_every=1",
        "train.progress=false", "checkpoint.every_seconds=None", "train.threads=1", "optim.schedule=constant"]


def _train(run: Path, *extra: str) -> dict:
    return train(load_config(None, [*BASE, f"run.dir={run}", *extra]))


def _changed_config_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "resuming with a changed config" in r.getMessage()]


def test_larger_max_steps_continues_a_finished_run_bit_for_bit(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    straight = _train(tmp_path / "straight", "train.max_steps=10")
    run = tmp_path / "run"
    assert _train(run, "train.max_steps=6")["steps"] == 6
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        extended = _train(run, "train.max_steps=10")
    assert extended["steps"] == 10 and extended["outcome"] == "finished"
    assert extended["params_sha256"] == straight["params_sha256"]  # as if it had never stopped
    assert [s for s, _ in layout.committed(run / "checkpoints")][-1] == 10
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s > 6] == sorted(s for s in steps if s > 6)  # rows go on from step 7
    assert any("continuing the finished run" in r.getMessage() for r in caplog.records)
    # the message names the one key that changed, and nothing else
    assert [line.split(": ", 1)[1] for line in _changed_config_lines(caplog)] == ["train.max_steps: 6 -> 10"]


def test_same_goal_still_refused_with_the_hint_to_extend(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, "train.max_steps=4")
    for same in ("train.max_steps=4", "train.max_steps=3"):
        with pytest.raises(RunDirError, match="finished run .*nothing to resume; hint: a larger train.max_steps"):
            _train(run, same)
    assert json.loads((run / "summary.json").read_text())["steps"] == 4  # untouched


def test_more_epochs_that_train_no_step_are_refused_after_the_resume(tmp_path: Path) -> None:
    """Epochs raised, but a 8x larger batch makes 3 epochs 6 steps, fewer than the 16 done:
    refused once the data says so, the finished run's summary.json kept."""
    run = tmp_path / "run"
    _train(run, "train.epochs=1")
    before = (run / "summary.json").read_bytes()
    with pytest.raises(RunDirError, match="already holds a finished run .*nothing to resume"):
        _train(run, "train.epochs=3", "data.global_batch_size=128", "data.batch_size=128")
    assert (run / "summary.json").read_bytes() == before


def test_finished_run_without_checkpoints_cannot_be_continued(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, "train.max_steps=4", "checkpoint.enabled=false")
    with pytest.raises(RunDirError, match="finished run without checkpoints: it cannot be continued"):
        _train(run, "train.max_steps=8")


def test_cosine_schedule_is_recomputed_for_the_longer_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The 4-step cosine ends at lr 0; the first step past it uses the 5-step curve's rate, so
    the weights move (restored as saved, the old curve's 0 would leave them where they were)."""
    run = tmp_path / "run"
    ended = _train(run, "train.max_steps=4", "optim.schedule=cosine")
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        extended = _train(run, "train.max_steps=5", "optim.schedule=cosine")
    assert any("LR schedule recomputed for a run of 5 steps" in r.getMessage() for r in caplog.records)
    assert extended["steps"] == 5 and extended["params_sha256"] != ended["params_sha256"]


def test_extended_at_another_world_size(tmp_path: Path) -> None:
    """1 rank for 4 steps, then 2 ranks to 8: the same global batch, so the same samples."""
    run = tmp_path / "run"
    _train(run, "train.max_steps=4")
    [rank0, _] = train_cases(2, [("run", [*BASE, "train.max_steps=8"])], tmp_path, keep=("steps", "world_size"))
    assert rank0["run"] == {"steps": 8, "world_size": 2}


def test_config_changes_lists_only_what_changed() -> None:
    cfg = to_dict(load_config(None, BASE))
    assert config_changes(cfg, {}) == [] and config_changes({}, cfg) == []  # a side that records no config
    other = to_dict(load_config(None, [*BASE, "optim.lr=0.5"]))
    assert config_changes(cfg, other) == [f"optim.lr: {cfg['optim']['lr']!r} -> 0.5"]
    missing = {k: v for k, v in other.items() if k != "telemetry"}
    missing["telemetry"] = {"loggers": cfg["telemetry"]["loggers"]}  # a section with fewer keys
    changes = config_changes(cfg, missing)
    assert "optim.lr: " in changes[0] and all(c.startswith(("optim.lr", "telemetry.")) for c in changes)
    assert not any(c.startswith("telemetry.loggers") for c in changes)
