"""Signals under ``hpctrain run`` end a job with the ranks' own answer (issue 24, issue 25).

- A forwarded SIGUSR1 that the ranks answer with exit 3 leaves the launcher with 3, not 138
  (Slurm's requeue trap looks at it), for any program.
- A preemption signal during the resume (reading a checkpoint that blocks: a hung file
  system, a FIFO where a file was expected) ends the job with 3 at once; before, it was only
  recorded and the resume went on blocking until the allocation's end.
- A SIGUSR1 during DeepSpeed's first op build (ninja, in the rank's process group, which torch's
  agent signals as a whole) neither kills the build nor is lost: the rank honours it after.

Each through a real launcher subprocess (the signals need one); the programs are small files
written by the tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.core.errors import EXIT_PREEMPTED
from tests.dist_utils import finish_launch, launch_env

pytestmark = pytest.mark.slow  # launches: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]

PLAIN = '''
import os, signal, sys, time
from pathlib import Path

signal.signal(signal.SIGUSR1, lambda signum, frame: sys.exit(3))  # "saved; requeue me"
Path(sys.argv[1], "ready-" + os.environ["RANK"]).touch()
while True:
    time.sleep(0.05)
'''

def write_program(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def start(nproc: int, program: list[str], *options: str, **env: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "hpctrain", "run", "-n", str(nproc), *options, *program]
    return subprocess.Popen(cmd, cwd=ROOT, env=launch_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"ended before {path.name} appeared:\n{proc.communicate()[0].decode()[-4000:]}")
        assert time.monotonic() < deadline, f"no {path} within {timeout} s"
        time.sleep(0.02)


def test_the_ranks_exit_3_after_a_forwarded_sigusr1_is_the_launchers_exit_code(tmp_path: Path) -> None:
    program = write_program(tmp_path, "plain.py", PLAIN)
    proc = start(2, [str(program), str(tmp_path)], "--hang-timeout=0")
    for rank in (0, 1):
        wait_for(tmp_path / f"ready-{rank}", proc)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out = finish_launch(proc, timeout=120)
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert "SIGUSR1 forwarded to the ranks; all of them exited with 3" in out


# DeepSpeed's first use, as hpctrain.parallel.deepspeed.init_deepspeed runs it, with a stand-in for
# DeepSpeed whose op build is a child process in the rank's process group, like ninja: it tells it
# started (WORK/building) and runs until WORK/go appears.
DEEPSPEED_BUILD = '''
import os, signal, subprocess, sys, types
from pathlib import Path

import torch

from hpctrain.checkpoint.preempt import SignalFlag
from hpctrain.core.env import detect
from hpctrain.parallel import deepspeed

WORK = Path(sys.argv[1])
NINJA = ("import sys, time; from pathlib import Path; work = Path(sys.argv[1]); (work / 'building').touch()\\n"
         "while not (work / 'go').exists(): time.sleep(0.02)")


def build_ops(**kwargs):
    subprocess.run([sys.executable, "-c", NINJA, str(WORK)], check=True)


fake = types.SimpleNamespace(init_distributed=build_ops, initialize=lambda **kw: (kw["model"], None, None, None))
deepspeed.import_deepspeed = lambda: fake
flag = SignalFlag(["SIGUSR1"])  # the trainer's, installed before the strategy is built
flag.install()
(WORK / "outcomes").write_text(os.environ["HPCTRAIN_OUTCOME_DIR"])
model = torch.nn.Linear(2, 2)
deepspeed.init_deepspeed(model, torch.optim.SGD(model.parameters(), lr=0.1), env=detect(), stage=1, micro_batch=1)
print("build finished", flush=True)
if flag.requested:
    print(signal.Signals(flag.received).name, "honoured after the build", flush=True)
    sys.exit(3)
'''


def test_a_sigusr1_during_deepspeeds_op_build_spares_the_build_and_is_honoured_after(tmp_path: Path) -> None:
    program = write_program(tmp_path, "deepspeed_build.py", DEEPSPEED_BUILD)
    proc = start(1, [str(program), str(tmp_path)], "--hang-timeout=0")
    wait_for(tmp_path / "building", proc)
    os.kill(proc.pid, signal.SIGUSR1)  # torch's agent sends it to the rank's whole process group
    wait_for(Path((tmp_path / "outcomes").read_text(), "forwarded-0-SIGUSR1"), proc)  # it has
    time.sleep(0.3)  # the group's processes get it
    (tmp_path / "go").touch()
    code, out = finish_launch(proc, timeout=120)
    assert "build finished" in out and "SIGUSR1 honoured after the build" in out, out[-3000:]
    assert code == EXIT_PREEMPTED, out[-3000:]


def test_inside_a_phase_a_signal_ends_it_with_3_and_outside_only_sets_the_flag() -> None:
    from hpctrain.checkpoint.preempt import Preempted, SignalFlag

    flag, ended = SignalFlag(["SIGUSR1"]), []
    flag.install()
    try:
        with pytest.raises(Preempted) as raised, flag.interrupting("the resume", ended.append):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(30)  # a read that blocks: the handler raises out of it
        assert raised.value.code == EXIT_PREEMPTED and raised.value.phase == "the resume" and ended == [raised.value]
        with flag.interrupting("the resume"):  # a signal from before the phase keeps its meaning
            pass
        for wrap in (True, False):  # a library that wraps a rank's error in its own (DCP does), or drops it
            with pytest.raises(Preempted) as converted, flag.interrupting("the resume"):
                try:
                    os.kill(os.getpid(), signal.SIGUSR1)
                    time.sleep(30)
                except Preempted as err:
                    if wrap:
                        raise RuntimeError("rank 1 failed") from err
            assert converted.value.signal_name == "SIGUSR1"
            assert isinstance(converted.value.__cause__, RuntimeError) == wrap
        os.kill(os.getpid(), signal.SIGUSR1)  # outside a phase: recorded only
        assert flag.received == signal.SIGUSR1
    finally:
        flag.uninstall()


def test_a_signal_during_a_resume_that_blocks_exits_3_and_status_json_says_preempted(tmp_path: Path) -> None:
    """Rank 1 of `hpctrain train` blocks in open() of a FIFO while it resumes (rank 0 waits for
    it in a collective). SIGTERM to the launcher: both ranks end with 3 at once, not after
    --shutdown-timeout; before, the signal was only recorded and the resume blocked on."""
    fifo, run_dir = tmp_path / "fifo", tmp_path / "run"
    os.mkfifo(fifo)
    proc = start(2, ["train", f"model.name={__name__}:blocking_resume_mlp", "data.name=synthetic_tiny",
                     "data.synthetic_size=256", "data.batch_size=16", "train.max_steps=2", "train.progress=false",
                     f"run.dir={run_dir}"], "--hang-timeout=0", "--shutdown-timeout=100",
                 BLOCK_RANK="1", BLOCK_FIFO=str(fifo))
    wait_for(Path(f"{fifo}.waiting"), proc)
    time.sleep(0.3)  # into the blocking open(), though a signal just before it ends the phase alike
    os.kill(proc.pid, signal.SIGTERM)
    code, out = finish_launch(proc, timeout=90)  # --shutdown-timeout would end it only after 100 s
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert "SIGTERM during the resume: nothing new to save, exit 3" in out
    assert "SIGTERM forwarded to the ranks; all of them exited with 3" in out
    assert "internal error" not in out and "Traceback" not in out, out[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["outcome"], status["during"]) == ("preempted", "the resume")


def blocking_resume_mlp(num_classes: int = 10) -> object:
    """tests.user_models:tiny_mlp, built by a factory that also makes the resume of rank
    $BLOCK_RANK block in open() of the FIFO $BLOCK_FIFO (after touching FIFO.waiting)."""
    from hpctrain.checkpoint.checkpointer import Checkpointer
    from tests.user_models import tiny_mlp

    original = Checkpointer._resume

    def resume(self: Checkpointer, spec: str) -> bool:
        if os.environ.get("RANK") == os.environ.get("BLOCK_RANK"):
            fifo = Path(os.environ["BLOCK_FIFO"])
            Path(f"{fifo}.waiting").touch()
            fifo.read_bytes()
        return original(self, spec)

    Checkpointer._resume = resume  # type: ignore[method-assign]
    return tiny_mlp(num_classes)
