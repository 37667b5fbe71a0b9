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

import errno
import os
from collections.abc import Callable
from typing import TypeVar

EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 3
EXIT_HUNG = 4  # hpctrain run's watchdog found a rank without progress (hpctrain.launch.watchdog)

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


# What to do about an I/O error, by errno. Never "delete it": a file that cannot be read may
# be the only copy of a checkpoint or a data set, and a permission problem is not corruption.
_IO_HINTS = {
    errno.ENOSPC: "free space on that file system (or use another location), then run the command again; "
                  "training resumes from its last committed checkpoint",
    errno.EDQUOT: "free space or ask for a larger quota, then run the command again; training resumes from its "
                  "last committed checkpoint",
    errno.EROFS: "that file system is mounted read-only: choose a writable location",
    errno.EACCES: "check the permissions of the path and its folders (and who runs the job)",
    errno.EPERM: "check the permissions of the path and its folders (and who runs the job)",
    errno.ENOENT: "check that the path exists (a folder on the way may be missing)",
    errno.ENOTDIR: "a file stands where a folder is expected on that path",
    errno.EISDIR: "a folder stands where a file is expected",
    errno.EIO: "the storage reported an I/O error: check the disk or the file system's health",
}
IO_ERRNOS = frozenset(_IO_HINTS)  # errors of the machine or the file system, not bugs of hpctrain


def io_message(action: str, path: object, err: OSError) -> str:
    """``cannot ACTION PATH: STRERROR; hint: ...``: one line for an I/O error, naming the path."""
    reason = (err.strerror or os.strerror(err.errno)) if err.errno else str(err)
    hint = _IO_HINTS.get(err.errno or 0, "check the path, its permissions and the free space")
    return f"cannot {action} {path}: {reason}; hint: {hint}"


class RunIOError(RunError):
    """Reading or writing a path failed mid-run (disk full, read-only, permission denied). Exit
    code 1. The message is :func:`io_message`'s (a plain message: it pickles across processes)."""


class UserIOError(UserError):
    """A path given as input cannot be read or written (read-only, permission denied). Exit code 2."""


_RUN_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})  # a retry may succeed; the path itself is fine


def io_error(action: str, path: object, err: OSError) -> HpctrainError:
    """The error to raise for ``err``: a full disk or a failing device is a failed run (exit 1,
    run it again once fixed); a path that is read-only, forbidden or missing is wrong input
    (exit 2, choose another)."""
    cls = RunIOError if err.errno in _RUN_FAILURES else UserIOError
    return cls(io_message(action, path, err))


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
    outcome = None if error is None else (dist.get_rank(), describe(error), _exit_code(error))
    outcomes: list[tuple[int, str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    if error is not None:
        raise error
    failed = [o for o in outcomes if o is not None]
    if failed:
        rank, message, code = failed[0]
        raise PeerError(f"{phase} failed on rank {rank}: {message}", exit_code=code)
    return result  # type: ignore[return-value]


def describe(error: BaseException) -> str:
    """An error in one line: its own message if hpctrain raised it on purpose, else type and message."""
    return str(error) if isinstance(error, HpctrainError) else f"{type(error).__name__}: {error}"


def _exit_code(error: BaseException) -> int:
    return error.exit_code if isinstance(error, HpctrainError) else EXIT_RUN_FAILED


class UserCodeError(UserError):
    """The user's model (``model.name``) or loss (``train.loss``) raised while it ran. Exit code 2."""


def user_code_error(error: BaseException, model_name: str | None, loss_name: str | None) -> UserCodeError | None:
    """``error`` as a one-line :class:`UserCodeError` naming ``model.name`` or ``train.loss`` when the
    code hpctrain called last (outside torch and the standard library) is the user's: a module's
    ``forward`` that torch's ``Module.__call__`` entered, or the module of ``train.loss``. None when
    the innermost such frame is hpctrain's own (a bug in hpctrain, reported as one) or the code is
    neither (a collate, a metric: not this rule's to name)."""
    frames = _frames(error)
    ours = [i for i, (path, _, _) in enumerate(frames) if _in_package(path, "hpctrain")]
    if not ours or _in_package(frames[-1][0], "hpctrain"):
        return None
    inner = frames[ours[-1] + 1:]  # what hpctrain's last frame called
    user = [f for f in inner if not _library(f[0])]
    if not user:
        return None
    key = _culprit(user[0][2], inner, model_name, loss_name)
    if key is None:
        return None
    text = str(error).strip().splitlines()
    path, line, _ = user[-1]
    return UserCodeError(f"{key[0]}={key[1]!r} raised {type(error).__name__}: {text[0] if text else ''} "
                         f"(at {path}:{line}); hint: this is the model's or loss's own code failing on a batch, "
                         "not hpctrain's: fix it there")


def _culprit(module: str, inner: list[tuple[str, int, str]], model_name: str | None,
             loss_name: str | None) -> tuple[str, str] | None:
    """(key, value) of the user code hpctrain entered: train.loss when its module was entered (a
    loss in the model's own module only when no nn.Module call led there), model.name when
    torch's ``Module.__call__`` led there (a forward)."""
    module_call = any(_in_package(path, "torch") and path.endswith("module.py") for path, _, _ in inner)
    model_module = (model_name or "").partition(":")[0]
    if loss_name and module == loss_name.partition(":")[0] and not (module_call and module == model_module):
        return "train.loss", loss_name
    if model_name and module_call:
        return "model.name", model_name
    return None


def _frames(error: BaseException) -> list[tuple[str, int, str]]:
    """(file, line, module) of every frame of ``error``'s traceback, outermost first."""
    out, tb = [], error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        out.append((frame.f_code.co_filename, tb.tb_lineno, str(frame.f_globals.get("__name__", ""))))
        tb = tb.tb_next
    return out


def _in_package(path: str, package: str) -> bool:
    import sys

    mod = sys.modules.get(package)
    root = os.path.dirname(getattr(mod, "__file__", None) or "") if mod else ""
    return bool(root) and os.path.abspath(path).startswith(root + os.sep)


def _library(path: str) -> bool:
    """torch's or the standard library's code: never the culprit this rule names."""
    import sysconfig

    paths = sysconfig.get_paths()
    full = os.path.abspath(path)
    installed = any(full.startswith(paths[k] + os.sep) for k in ("purelib", "platlib"))  # transformers: a model's
    return (_in_package(path, "torch") or path.startswith("<")
            or (full.startswith(paths["stdlib"] + os.sep) and not installed))
