"""The first cause is the one reported (issue 25): when a rank is killed, the others fail in
their next collective with an error that names nothing ("Connection closed by peer"), and
used to report it as "internal error ... This is a bug in hpctrain", in status.json too.
``hpctrain run`` notes each rank it saw end with a failure before it stops the others; the
survivors name that rank instead."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from hpctrain.core import protocol
from hpctrain.core.errors import RunError
from hpctrain.core.protocol import OUTCOME_ENV
from hpctrain.launch import rank as rank_life
from tests.checkpoint import test_preempt as preempt
from tests.dist_utils import finish_launch
from tests.launch.test_hang import TINY, _rank_pid
from tests.launch.test_signal_exit import start

GLOO_LOST = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                         "[127.0.0.1]:6034. This is typically caused by a remote worker crashing.")


def _rank_env(tmp_path: Path, rank: int, restart: int = 0) -> dict[str, str]:
    return {OUTCOME_ENV: str(tmp_path), "RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(restart)}


def test_a_survivor_names_the_rank_the_launcher_saw_die(tmp_path: Path) -> None:
    protocol.note_ended(tmp_path, "0", 0, 1)  # a survivor that already exited 1: not the first cause
    protocol.note_ended(tmp_path, "0", 1, -signal.SIGKILL)
    protocol.note_ended(tmp_path, "1", 3, -signal.SIGSEGV)  # another attempt's
    replaced = rank_life.peer_failure(GLOO_LOST, wait_s=0, environ=_rank_env(tmp_path, 2))
    assert isinstance(replaced, RunError)
    assert str(replaced).startswith("rank 1 ended with signal 9 (SIGKILL), so this rank failed too (RuntimeError: "
                                    "Connection closed by peer [127.0.0.1]:6034.")
    assert protocol.ended_ranks(_rank_env(tmp_path, 1)) == {0: 1}  # its own note is not a peer's
    # an error of this rank's own is put down to a rank killed by a signal, not to one that exited
    assert str(rank_life.peer_failure(KeyError("x"), wait_s=0, environ=_rank_env(tmp_path, 2))).startswith("rank 1 ")
    assert rank_life.peer_failure(KeyError("x"), wait_s=0, environ=_rank_env(tmp_path, 1)) is None


def test_without_a_note_a_lost_peer_is_still_no_bug_and_other_errors_stand(tmp_path: Path) -> None:
    protocol.note_ended(tmp_path, "0", 1, 3)  # a preempted rank's exit 3 is no failure
    env = _rank_env(tmp_path, 0)
    lost = rank_life.peer_failure(GLOO_LOST, wait_s=0, environ=env)
    assert isinstance(lost, RunError) and str(lost).startswith("a collective failed because another rank")
    assert rank_life.peer_failure(KeyError("x"), wait_s=0, environ=env) is None
    with pytest.raises(KeyError), rank_life.first_cause(env):
        raise KeyError("x")  # a bug stays a bug
    with pytest.raises(RunError, match="a collective failed"), rank_life.first_cause({**env, OUTCOME_ENV: ""}):
        raise GLOO_LOST


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_the_survivor_of_a_sigkill_reports_it_and_status_json_records_it(tmp_path: Path, killed: int) -> None:
    """Rank 0 writes status.json: killed, the launcher records the cause there instead."""
    run_dir = tmp_path / "run"
    proc = start(2, ["train", *TINY, "model.name=tests.user_models:slow_mlp", f"run.dir={run_dir}"],
                 "--hang-timeout=0")
    preempt._wait_for_step(run_dir, 3, proc)
    os.kill(_rank_pid(proc.pid, killed), signal.SIGKILL)
    code, out = finish_launch(proc, timeout=120)
    cause = f"rank {killed} ended with signal 9 (SIGKILL)"
    assert code == 1, out[-3000:]
    assert f"hpctrain train: error: {cause}, so this rank failed too" in out, out[-3000:]
    assert "internal error" not in out and "This is a bug" not in out, out[-3000:]
    assert f"hpctrain run: hpctrain failed: {cause} first; exit code 1" in out
    status = json.loads((run_dir / "status.json").read_text())
    assert status["outcome"] == "failed" and status["error"].startswith(cause), status
