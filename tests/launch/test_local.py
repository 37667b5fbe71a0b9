"""``hpctrain run``'s torchrun command line and exit codes, without launching (the launches under
signals, SIGKILL and restarts are in tests/checkpoint/test_preempt.py)."""

from __future__ import annotations

import pytest

from hpctrain.launch.local import signals_to_handle, torchrun_accepts, torchrun_args


def test_torchrun_args_ask_torch_to_forward_the_preemption_signals() -> None:
    args = torchrun_args(2, ["train"], signals=["SIGUSR1", "SIGTERM"], shutdown_timeout=120, node_rank=1)
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in args
    assert "--node-rank=1" in args
    assert ("--shutdown-timeout=120" in args) == torchrun_accepts("--shutdown-timeout")  # torch 2.11 lacks it
    assert signals_to_handle(["SIGUSR2", "SIGTERM", "SIGUSR2"]) == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR2"]


def test_options_this_torch_lacks_are_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster's torch may predate --shutdown-timeout (2.11 has none): leave it out, never fail."""
    from hpctrain.launch import local

    monkeypatch.setattr(local, "torchrun_accepts", lambda option: option != "--shutdown-timeout")
    args = torchrun_args(2, ["train"], signals=["SIGUSR1"])
    assert not any(a.startswith("--shutdown-timeout") for a in args)
    assert any(a.startswith("--signals-to-handle=") for a in args)
    assert local.get_args_parser().parse_args(args)  # what is left parses


def test_this_torchs_parser_is_asked_not_its_version() -> None:
    from hpctrain.launch.local import torchrun_accepts

    assert torchrun_accepts("--nproc-per-node")
    assert not torchrun_accepts("--no-such-option-anywhere")


def test_the_first_rank_to_fail_gives_the_exit_code_not_a_rank_killed_after_it() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from hpctrain.launch.local import rank_exit_code

    def failure(rank: int, code: int, when: float) -> ProcessFailure:
        found = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
        found.timestamp = int(when)
        return found

    killed_later = {0: failure(0, -15, 20), 1: failure(1, 2, 10)}
    assert rank_exit_code(ChildFailedError("hpctrain", killed_later)) == 2
    assert rank_exit_code(ChildFailedError("hpctrain", {0: failure(0, -9, 5)})) == 1
