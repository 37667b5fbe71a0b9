"""An exception in the user's model forward or loss while training exits 2 naming model.name or
train.loss with the exception's one-line message (issue 24, point 6), not "internal error ... a
bug in hpctrain"; an exception raised in hpctrain's own code stays an internal error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from hpctrain.cli import main
from hpctrain.core.errors import user_code_error
from tests.dist_utils import ROOT

MOD = "tests.test_user_forward_errors"
BASE = ["train", "data.name=synthetic_tiny", "data.synthetic_size=64", "data.batch_size=16", "train.max_steps=2",
        "train.progress=false", "train.threads=1", "checkpoint.enabled=false"]


class FailsInTraining(nn.Module):
    """Passes hpctrain's dummy forward (eval mode), fails on the first training batch."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            raise ValueError("my layer got a batch it cannot take\nsecond line")
        return self.fc(x.flatten(1)[:, :64])


def failing_model(num_classes: int = 10) -> nn.Module:
    return FailsInTraining(num_classes)


def failing_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    raise KeyError("my loss needs a 'weights' entry")


def _train(capsys: pytest.CaptureFixture[str], tmp_path, *extra: str) -> tuple[int, str]:
    code = main([*BASE, f"run.dir={tmp_path / 'run'}", *extra])
    return code, capsys.readouterr().err


def test_a_forward_that_raises_in_training_exits_2_naming_model_name(tmp_path, capsys):
    code, err = _train(capsys, tmp_path, f"model.name={MOD}:failing_model")
    assert code == 2, err
    assert f"model.name='{MOD}:failing_model' raised ValueError: my layer got a batch it cannot take (at " in err
    assert "internal error" not in err and "Traceback" not in err and "second line" not in err


def test_a_loss_that_raises_exits_2_naming_train_loss(tmp_path, capsys):
    code, err = _train(capsys, tmp_path, "model.name=tests.user_models:tiny_mlp", f"train.loss={MOD}:failing_loss")
    assert code == 2, err
    assert f"train.loss='{MOD}:failing_loss' raised KeyError: \"my loss needs a 'weights' entry\"" in err
    assert "internal error" not in err and "Traceback" not in err


def test_an_error_raised_in_hpctrain_itself_is_not_blamed_on_the_user() -> None:
    from hpctrain.data.manifest import padded

    with pytest.raises(TypeError) as caught:
        padded("x")  # type: ignore[arg-type]  # raised in hpctrain's frame: a bug there, not user code
    assert user_code_error(caught.value, f"{MOD}:failing_model", f"{MOD}:failing_loss") is None
    with pytest.raises(ValueError) as forward:
        FailsInTraining()(torch.zeros(2, 64))  # the user's forward, but not called by hpctrain
    assert user_code_error(forward.value, f"{MOD}:failing_model", None) is None


@pytest.mark.slow
def test_two_ranks_both_exit_2_naming_model_name_without_a_hang(tmp_path) -> None:
    """`hpctrain run -n 2`: every rank's forward raises; the job ends with 2 and the key, no rank waits."""
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "run", "-n", "2", *BASE, f"run.dir={tmp_path / 'run'}",
                           f"model.name={MOD}:failing_model", "parallel.backend=gloo"],
                          capture_output=True, text=True, cwd=ROOT, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"model.name='{MOD}:failing_model' raised ValueError: my layer got a batch it cannot take" in proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
