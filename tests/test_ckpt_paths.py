"""Checkpoints where users point (issue 38, point 4): ``hpctrain eval --weights`` and ``hpctrain
ckpt list / verify / export`` take a run directory, its ``checkpoints/`` folder or one
checkpoint (``step-N``), through one resolver (hpctrain.weights.locate), and say which one they
used; a path with nothing committed is exit 2. One tiny in-process run (two checkpoints)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint import layout
from hpctrain.cli import main as cli_main
from hpctrain.config import load_config
from hpctrain.train import train
from hpctrain.weights.locate import FOLDER, ONE, RUN, locate

BASE = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=64",
        "data.batch_size=16", "data.max_val_samples=32", "train.max_steps=4", "checkpoint.every_steps=2",
        "train.progress=false", "checkpoint.every_seconds=None", "train.threads=1"]
EVAL = [k for k in BASE if not k.startswith(("train.max_steps", "checkpoint."))]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("paths") / "run"
    train(load_config(None, [*BASE, f"run.dir={run_dir}"]))
    assert [s for s, _ in layout.committed(run_dir / "checkpoints")] == [2, 4]
    return run_dir


def test_the_three_forms_resolve_to_the_same_checkpoints(run: Path) -> None:
    steps = run / "checkpoints"
    assert (locate(run).kind, locate(steps).kind, locate(steps / "step-000000002").kind) == (RUN, FOLDER, ONE)
    assert locate(run).checkpoints == locate(steps).checkpoints == layout.committed(steps)
    assert locate(steps / "step-000000002").checkpoints == [(2, steps / "step-000000002")]


@pytest.mark.parametrize("form", ["", "checkpoints", "checkpoints/step-000000002"])
def test_ckpt_list_and_verify_take_each_form_and_say_what_they_read(run: Path, form: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = run / form if form else run
    assert cli_main(["ckpt", "list", str(path)]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("step-")]
    assert listed == (["step-000000002"] if "step-" in form else ["step-000000002", "step-000000004"])
    first = out.splitlines()[0]
    assert first == (f"checkpoint {path}" if "step-" in form else
                     f"{RUN if not form else FOLDER} {path}: 2 committed checkpoints in {run / 'checkpoints'}")
    assert cli_main(["ckpt", "verify", str(path)]) == 0
    assert capsys.readouterr().out.count(": ok") == len(listed)


@pytest.mark.parametrize("command", ["list", "verify", "export"])
def test_nothing_committed_there_is_exit_2_naming_the_path(tmp_path: Path, command: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    partial = tmp_path / "run" / "checkpoints" / "step-000000003"
    partial.mkdir(parents=True)  # a save that never finished: no manifest
    out = [str(tmp_path / "w.pt")] if command == "export" else []
    for path, said in ((tmp_path / "run", "holds no committed checkpoint"),
                       (partial, "is not a committed checkpoint (no manifest.json"),
                       (tmp_path / "nowhere", "does not exist")):
        assert cli_main(["ckpt", command, str(path), *out]) == 2
        err = capsys.readouterr().err
        assert f"{path} {said}" in err and "Traceback" not in err and "hint:" in err
    assert not (tmp_path / "w.pt").exists()


def test_export_of_a_checkpoints_folder_takes_the_newest_and_says_so(run: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["ckpt", "export", str(run / "checkpoints"), str(tmp_path / "w.pt")]) == 0
    assert f"step 4, from {run / 'checkpoints' / 'step-000000004'}" in capsys.readouterr().out
    final = torch.load(run / "model.pt", weights_only=True)  # step 4 is the end of the run
    exported = torch.load(tmp_path / "w.pt", weights_only=True)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)


def test_eval_takes_one_checkpoint_a_folder_and_a_run_and_says_which(run: Path, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hpctrain")
    step2 = run / "checkpoints" / "step-000000002"
    assert cli_main(["ckpt", "export", str(step2), str(tmp_path / "step2.pt")]) == 0
    results = {}
    for name, weights in (("file", tmp_path / "step2.pt"), ("one", step2), ("folder", run / "checkpoints"),
                          ("run", run)):
        assert cli_main(["eval", *EVAL, "--weights", str(weights), "--out", str(tmp_path / name)]) == 0
        results[name] = json.loads((tmp_path / name / "eval.json").read_text())
    assert results["one"]["loss"] == results["file"]["loss"]  # the checkpoint's weights, exactly
    assert results["folder"]["loss"] != results["one"]["loss"]  # the newest: step 4
    assert results["run"]["weights"] == str(run / "model.pt") and results["folder"]["loss"] == results["run"]["loss"]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval: weights from")]
    assert said[1] == f"eval: weights from checkpoint {step2} (step 2)"
    assert said[2].startswith(f"eval: weights from checkpoint {run / 'checkpoints' / 'step-000000004'} (step 4; ")
    assert said[3] == f"eval: weights from {run / 'model.pt'} (the run's final weights)"


def test_eval_of_a_checkpoint_writes_next_to_the_run_not_into_the_checkpoint(run: Path) -> None:
    step2 = run / "checkpoints" / "step-000000002"
    assert cli_main(["eval", *EVAL, "--weights", str(step2)]) == 0
    assert (run / "eval.json").is_file() and not (step2 / "eval.json").exists()
    assert layout.verify(step2) == []


def test_eval_with_nothing_there_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert cli_main(["eval", *EVAL, "--weights", str(tmp_path / "empty")]) == 2
    assert f"{tmp_path / 'empty'} holds no committed checkpoint" in capsys.readouterr().err
