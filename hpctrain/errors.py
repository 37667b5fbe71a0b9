"""One error hierarchy for the whole package, so the CLI catches one thing.

- :class:`UserError` (exit 2): the input is wrong (config, paths, data, weights). Fix it,
  do not retry. Messages name the file, key or value and give a hint.
- :class:`RunError` (exit 1): the run failed (a write failed, a corrupt sample mid-run, a
  rank failed). A batch script treats it as a crash.

Every module raises a subclass of one of these; nothing else reaches the user as a
traceback. :func:`agree` turns one rank's error into the same error on every rank, so a
phase that ends in a collective never leaves the other ranks waiting in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 3

T = TypeVar("T")


class HpctrainError(Exception):
    """Base of every error hpctrain raises on purpose; ``exit_code`` is the CLI's."""

    exit_code = EXIT_RUN_FAILED


class UserError(HpctrainError, ValueError):
    """Wrong input: the message names the culprit and a hint. Exit code 2."""

    exit_code = EXIT_USER_ERROR


class RunError(HpctrainError, RuntimeError):
    """The run failed (I/O, corruption found mid-run, another rank failed). Exit code 1."""

    exit_code = EXIT_RUN_FAILED


class PeerError(RunError):
    """Raised on the ranks that did not fail, naming the rank that did and its message."""

    def __init__(self, message: str, exit_code: int = EXIT_RUN_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def agree(phase: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank, then agree on success before anyone goes on.

    Call it around a phase whose end is a collective (a broadcast of the resume choice, an
    all-reduce of eval metrics): when one rank raises, every rank raises within one
    collective instead of waiting in it until the timeout. The failing rank re-raises its
    own error; the others raise :class:`PeerError` with the same message and exit code.
    Without a process group it is just ``fn()``.
    """
    import torch.distributed as dist  # here: every module imports this one, few of them need torch

    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    error: BaseException | None = None
    result: T | None = None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - exchanged, then re-raised below
        error = err
    outcome = None if error is None else (dist.get_rank(), _describe(error), _exit_code(error))
    outcomes: list[tuple[int, str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    if error is not None:
        raise error
    failed = [o for o in outcomes if o is not None]
    if failed:
        rank, message, code = failed[0]
        raise PeerError(f"{phase} failed on rank {rank}: {message}", exit_code=code)
    return result  # type: ignore[return-value]


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, HpctrainError) else f"{type(error).__name__}: {error}"


def _exit_code(error: BaseException) -> int:
    return error.exit_code if isinstance(error, HpctrainError) else EXIT_RUN_FAILED
