"""``hpctrain slurm`` renders a job that extends a finished run (issue 24, point 5): it judges
run.dir with the train section, as ``hpctrain train`` does (hpctrain.core.rundir.check_run_dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.train import train

BASE = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=64",
        "data.global_batch_size=16", "data.max_val_samples=16", "train.progress=false", "train.threads=1",
        "checkpoint.every_seconds=None"]


def test_slurm_renders_a_job_that_extends_a_finished_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert train(load_config(None, [*BASE, f"run.dir={run}", "train.max_steps=2"]))["steps"] == 2
    capsys.readouterr()
    job = ["slurm", *BASE, f"run.dir={run}"]
    options = ["--nodes", "1", "--time", "10", "--dry-run"]  # positionals come before the options
    assert main([*job, "train.max_steps=4", *options]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n#SBATCH") and "train.max_steps=4" in out
    # the same goal is still refused, with the hint to raise it
    assert main([*job, "train.max_steps=2", *options]) == 2
    assert "nothing to resume; hint: a larger train.max_steps" in capsys.readouterr().err
