"""docs/cluster.md's Accelerate lines, as written there: a preemption signal in an Accelerate loop
ends in `accelerator.save_state`, exit 3, and the next start loads the state and finishes with the
uninterrupted loop's weights (one process, CPU, in this process)."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")


def _loop(ckpt: Path, signal_at: int | None) -> torch.Tensor:
    import accelerate

    from hpctrain.checkpoint.preempt import Preemption

    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    start = 0
    if ckpt.exists():
        accelerator.load_state(str(ckpt))
        start = int((ckpt / "step.txt").read_text())
    preemption = Preemption(["SIGUSR1"])
    try:
        for step in range(start, 12):
            x = torch.arange(4.0).repeat(3, 1) * (step + 1)  # the data by step: a resume sees the same batches
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if step == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            if preemption.agreed(step):
                accelerator.save_state(str(ckpt))
                (ckpt / "step.txt").write_text(str(step + 1))
                preemption.exit()
    finally:
        preemption.flag.uninstall()
    return accelerator.unwrap_model(model).weight.detach().clone()


def test_a_preempted_accelerate_loop_saves_exits_3_and_resumes_to_the_same_weights(tmp_path: Path) -> None:
    want = _loop(tmp_path / "reference", None)
    with pytest.raises(SystemExit) as ended:
        _loop(tmp_path / "ckpt", signal_at=4)
    assert ended.value.code == 3 and (tmp_path / "ckpt" / "step.txt").read_text() == "5"
    assert torch.equal(_loop(tmp_path / "ckpt", None), want)
