"""The hang bound holds wherever the loop is not saving, validating or resuming (issue 25).

Only the phases the loop marks as long (validation, a checkpoint save, the resume read) and
the first step get ``LONG_FACTOR`` x ``--hang-timeout``; the per-step preemption agreement
(after the meter's OTHER or EVAL lap) is judged at the plain timeout. Before, every phase after
those laps was "validation or the checkpoint schedule": a rank stopped in the agreement was
reported after 3 x the timeout. The resume read was not judged at all.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpctrain.core import protocol
from hpctrain.core.errors import EXIT_HUNG
from hpctrain.launch import watchdog
from hpctrain.telemetry import meter
from tests.dist_utils import finish_launch
from tests.launch.test_signal_exit import start, write_program

pytestmark = pytest.mark.slow  # launches: scheduled first (tests/conftest.py)

HANG_S = 3


def _beat(phase: int, done: int = 5) -> protocol.Beat:
    return protocol.Beat(rank=0, restart=0, pid=1, phase=phase, laps=30, step=5, done=done, time=0.0)


def test_only_marked_long_phases_and_the_first_step_get_the_long_allowance() -> None:
    plain, long = 10.0, 10.0 * watchdog.LONG_FACTOR
    for phase in (meter.DATA, meter.FORWARD, meter.BACKWARD, meter.OPTIM, meter.CKPT, meter.EVAL, meter.OTHER):
        assert watchdog.allowance(_beat(phase), 10.0) == plain, protocol.DOING_AFTER[phase]
    for phase in (protocol.VALIDATING, protocol.SAVING, protocol.RESUMING, protocol.FINISHING):
        assert watchdog.allowance(_beat(phase), 10.0) == long, protocol.DOING_AFTER[phase]
    assert watchdog.allowance(_beat(meter.OTHER, done=0), 10.0) == long  # the first step: compilation
    assert watchdog.allowance(_beat(protocol.RESUMING, done=0), 10.0) == long  # judged, unlike start-up
    assert watchdog.allowance(_beat(protocol.STARTING, done=0), 10.0) == float("inf")
    assert "preemption agreement" in protocol.DOING_AFTER[meter.OTHER]


@pytest.fixture
def fresh_heartbeat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process beats into tmp_path/beats, as a rank of hpctrain run would."""
    beats = tmp_path / "beats"
    beats.mkdir()
    monkeypatch.setenv(protocol.HEARTBEAT_ENV, str(beats))
    monkeypatch.setattr(protocol, "_current", None)
    yield beats
    monkeypatch.setattr(protocol, "_current", None)


def test_the_loop_marks_validation_saves_and_the_resume_and_nothing_else(
        tmp_path: Path, fresh_heartbeat: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the watchdog reads while the trainer (one process, in this one) agrees on a
    preemption, saves, validates and resumes: only the last three are long phases."""
    from hpctrain.checkpoint.checkpointer import Checkpointer
    from hpctrain.config import load_config
    from hpctrain.parallel.base import Strategy
    from hpctrain.train import train

    seen: list[tuple[str, int]] = []

    def looking(name: str, original):  # noqa: ANN001, ANN202 - a pass-through wrapper
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            beat = protocol.read_beat(protocol.beat_path(fresh_heartbeat, 0))
            seen.append((name, beat.phase if beat is not None else -99))
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(Checkpointer, "at_step", looking("agreement", Checkpointer.at_step))
    monkeypatch.setattr(Checkpointer, "_save", looking("save", Checkpointer._save))
    monkeypatch.setattr(Checkpointer, "_resume", looking("resume", Checkpointer._resume))
    monkeypatch.setattr(Strategy, "evaluate", looking("validation", Strategy.evaluate))
    keys = ["model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=64",
            "data.batch_size=16", "data.max_val_samples=16", "train.epochs=1", "train.max_steps=4",
            "train.eval_every_steps=2", "train.progress=false", "train.threads=1", "checkpoint.every_steps=2",
            f"run.dir={tmp_path / 'run'}"]
    train(load_config(None, keys))
    judged = {(name, watchdog.allowance(_beat(phase), 1.0)) for name, phase in seen}
    assert judged == {("agreement", 1.0), ("save", watchdog.LONG_FACTOR), ("validation", watchdog.LONG_FACTOR),
                      ("resume", watchdog.LONG_FACTOR)}, seen
    assert [name for name, _ in seen].count("agreement") == 4
    after = protocol.read_beat(protocol.beat_path(fresh_heartbeat, 0))
    assert after is not None and after.phase == protocol.FINISHING  # each mark gives back the phase before it


# A user's loop with the heartbeat's phases (as the meter laps them) and the per-step preemption
# agreement (one all-reduce); rank 1 stops itself right before the agreement at its 6th step.
AGREEMENT = '''
import os, signal

import torch
import torch.distributed as dist

from hpctrain.checkpoint.preempt import Preemption
from hpctrain.core import protocol
from hpctrain.telemetry.meter import CKPT, DATA, OPTIM, OTHER

dist.init_process_group("gloo")
rank, beat = dist.get_rank(), protocol.from_env()
preemption = Preemption(["SIGUSR1"])
grad = torch.ones(4)
for step in range(100_000):
    beat.beat(DATA)
    dist.all_reduce(grad)  # forward, backward and the gradient all-reduce
    beat.beat(OPTIM)  # the optimizer step ends a step
    beat.beat(OTHER)  # the after-step hooks end; the checkpoint schedule follows
    if rank == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGSTOP)
    preemption.agreed(step)
    beat.beat(CKPT)
'''


def _silence(summary: str) -> float:
    found = re.search(r"made no progress for (\d+) s", summary)
    assert found is not None, summary
    return float(found.group(1))


def test_a_rank_stopped_in_the_preemption_agreement_is_judged_at_the_plain_timeout(tmp_path: Path) -> None:
    program = write_program(tmp_path, "agreement.py", AGREEMENT)
    run_dir = tmp_path / "run"
    proc = start(2, [str(program)], f"--hang-timeout={HANG_S}", f"--run-dir={run_dir}")
    code, out = finish_launch(proc, timeout=120)
    assert code == EXIT_HUNG, out[-3000:]
    summary = next(run_dir.glob("hang-*/summary.txt")).read_text()
    assert "hang: rank 1 " in summary and "after step 6, in the step's end (the preemption agreement" in summary
    assert "process stopped" in summary, summary
    assert _silence(summary) < HANG_S * watchdog.LONG_FACTOR, summary  # the long allowance would wait that long
    assert json.loads((run_dir / "status.json").read_text())["outcome"] == "hung"


def test_a_resume_that_never_ends_is_reported_by_the_watchdog(tmp_path: Path) -> None:
    """Rank 1 of `hpctrain train` blocks in open() of a FIFO while it resumes: the resume phase
    is judged (3 x 1 s here); before, it was start-up, never judged: a time-out here."""
    fifo, run_dir = tmp_path / "fifo", tmp_path / "run"
    os.mkfifo(fifo)
    proc = start(2, ["train", "model.name=tests.launch.test_signal_exit:blocking_resume_mlp",
                     "data.name=synthetic_tiny", "data.synthetic_size=256", "data.batch_size=16", "train.max_steps=2",
                     "train.progress=false", f"run.dir={run_dir}"], "--hang-timeout=1",
                 BLOCK_RANK="1", BLOCK_FIFO=str(fifo))
    code, out = finish_launch(proc, timeout=120)
    assert code == EXIT_HUNG, out[-3000:]
    summary = next(run_dir.glob("hang-*/summary.txt")).read_text()
    assert "in the resume (reading a checkpoint)" in summary, summary
    assert json.loads((run_dir / "status.json").read_text())["outcome"] == "hung"
