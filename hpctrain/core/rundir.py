"""The run directory: config.yaml, metrics.jsonl, model.pt, summary.json.

metrics.jsonl is written by :class:`hpctrain.telemetry.loggers.JsonlLogger` (``telemetry.loggers``).

Files are written whole or not at all (temporary name, fsync, rename), and a finished
run is never overwritten unless ``run.overwrite=true``. hpctrain writes only into a folder
it creates, an empty one, or one holding its run marker (``.hpctrain-run.json``, which lists
the names it writes); ``run.overwrite=true`` removes only what the marker lists and
hpctrain's own entries of ``checkpoints/``. A finished run asked for more steps continues.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hpctrain.core.atomic import fsync_dir, write_json
from hpctrain.core.errors import UserError, agree, describe, io_error, io_message
from hpctrain.core.protocol import STATUS
from hpctrain.core.safe_open import UnsafeFileError, read_head
from hpctrain.core.safe_yaml import safe_yaml

if TYPE_CHECKING:
    from hpctrain.core.run_lock import RunDirLock

log = logging.getLogger("hpctrain")

SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"


class RunDirError(UserError):
    """The run directory cannot be used; the message says why and what to do."""


class _OneComponent:
    """A config section whose text values read as one path component: ``data.name=csv:data/x.csv``
    names ``runs/csv-data-x.csv-...``, not a folder ``csv:data`` with an ``x.csv-...`` inside."""

    def __init__(self, section: Any) -> None:
        self._section = section

    def __getattr__(self, name: str) -> Any:
        return _one_component(getattr(self._section, name))


def _one_component(value: Any) -> Any:
    if isinstance(value, str):
        return re.sub(r"[^\w.+-]+", "-", value).strip("-")
    return value if isinstance(value, (int, float, bool)) or value is None else _OneComponent(value)


def resolve_run_dir(template: str, cfg: Any) -> Path:
    """``run.dir`` may name config values (``runs/{data.name}-{model.name}``), the home folder
    (``~/runs``) and environment variables (``$SCRATCH/runs``, ``${SCRATCH}/runs``)."""
    expanded = _expand(template)
    sections = {name: _one_component(getattr(cfg, name)) for name in vars(cfg)}
    try:
        return Path(expanded.format(**sections))
    except (KeyError, AttributeError, IndexError, ValueError) as err:
        raise RunDirError(f"run.dir={template!r} names an unknown config key ({err})") from None


def _expand(template: str) -> str:
    """``~`` and ``$VAR`` expanded first (``${VAR}`` would read as a config key in braces); a
    variable that is not set is an error, never a folder literally named ``$VAR``."""
    expanded = os.path.expandvars(os.path.expanduser(template))
    unset = re.search(r"\$(\{\w+\}|\w+)", expanded)
    if unset:
        raise RunDirError(f"run.dir={template!r} names the environment variable {unset.group(0)}, which is not set; "
                          "hint: export it, or write the path out")
    if expanded.startswith("~"):
        raise RunDirError(f"run.dir={template!r}: {expanded.split('/')[0]!r} is not a known user's home; "
                          "hint: write the path out")
    return expanded


# ---------------------------------------------------------------- whose directory it is

BEST_FILE = "best.json"  # checkpoints/best.json, the best step's record (hpctrain.checkpoint.layout)
MARKER = ".hpctrain-run.json"  # hpctrain's claim on a run directory, listing the names it writes there
LOCK = ".hpctrain.lock"  # hpctrain.core.run_lock's (not imported: that module needs fcntl, this one runs anywhere)
CONFIG, SCRIPT = "config.yaml", "hpctrain.sbatch"
# The outputs of one run: what run.overwrite=true removes before a new run starts (when the
# marker lists them), so two runs' metrics, weights and summaries never mix. config.yaml and
# status.json are rewritten at once; the batch script, Slurm logs and hang reports of the job
# that is running now stay.
REPLACED = ("summary.json", "model.pt", "metrics.jsonl", "tensorboard", "profile", "report", "eval.json",
            "predictions.jsonl")
OWN_NAMES = (*REPLACED, CONFIG, STATUS, CHECKPOINTS, MARKER, LOCK, "wandb", SCRIPT, "slurm-jobs.json",
             "hpctrain-k8s.yaml", "k8s-preemptions.json")
OWN_PATTERNS = ("slurm-*.out", "slurm-*.err", "hang-*", ".*.tmp-*")
# Never a run directory: writing there would mix a run with a system's or a user's own files.
SYSTEM_ROOTS = frozenset({"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32",
                          "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp",
                          "/usr", "/usr/bin", "/usr/lib", "/usr/local", "/usr/share", "/var", "/var/lib",
                          "/var/log", "/var/tmp", "/scratch", "/data", "/work", "/lustre", "/gpfs", "/nfs"})
_NEVER_UNDER = ("/proc", "/sys", "/dev")
_OUTCOMES = ("running", "finished", "failed", "preempted", "hung")
_SECTIONS = {"model", "data", "train", "optim", "run", "checkpoint"}  # what every hpctrain config.yaml holds


def check_not_system_root(path: Path) -> None:
    """``run.dir=/``, the home folder (or one above it) and system roots are refused: a run
    there would write beside (and with run.overwrite=true remove from) files that are not its own."""
    real = Path(os.path.realpath(path))
    try:
        home: Path | None = Path(os.path.realpath(Path.home()))
    except (RuntimeError, KeyError):  # no HOME and no passwd entry (a bare container): no home to protect
        home = None
    system = str(real) in SYSTEM_ROOTS or any(str(real).startswith(f"{root}/") for root in _NEVER_UNDER)
    if system or (home is not None and (real == home or real in home.parents)):
        where = "your home folder" if real == home else "a system folder"
        raise RunDirError(f"run.dir {path} is {where} ({real}); hpctrain writes only into a run directory of its "
                          f"own; hint: name a subfolder, e.g. run.dir={path.joinpath('runs', 'run1')}")


def check_owner(path: Path) -> None:
    """Refuse a folder that holds files hpctrain did not write: hpctrain writes only into a
    folder it creates, an empty one, or one that holds its run marker (or is a run of an older
    hpctrain, recognised by its own config.yaml and status.json). Reads only."""
    if not path.exists():
        return
    if not path.is_dir():
        raise RunDirError(f"run.dir {path} is a file, not a folder; hint: choose another run.dir")
    names = _entries(path)
    if not names or MARKER in names or _older_run(path, names):
        return
    shown = ", ".join(f"{n}/" if (path / n).is_dir() else n for n in names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    raise RunDirError(f"run.dir {path} already holds files hpctrain did not write ({shown}{more}); hpctrain writes "
                      f"only into a new or empty folder or a run directory of its own ({MARKER}); hint: name a "
                      f"subfolder, e.g. run.dir={path / 'run1'}")


def check_links(path: Path) -> None:
    """Refuse a run directory where a name hpctrain writes or removes (every name the marker
    lists, its patterns, and hpctrain's own entries of ``checkpoints/``) is a symbolic link
    that leads out of it: run.overwrite=true would delete, and the run would write, in the
    folder it points to (a ``checkpoints`` link to another run's lost that run's checkpoints).
    A link that stays inside the run directory is followed as the folder it is. Reads only."""
    if not path.is_dir():
        return
    root = Path(os.path.realpath(path))
    for name in _entries(path):
        if name in OWN_NAMES or any(fnmatch.fnmatchcase(name, pattern) for pattern in OWN_PATTERNS):
            _refuse_link_out(path, root, Path(name))
    checkpoints = path / CHECKPOINTS
    if checkpoints.is_dir():  # a link out was refused above: this one lies inside
        for name in filter(_own_checkpoint_entry, _entries(checkpoints)):
            _refuse_link_out(path, root, Path(CHECKPOINTS, name))


def _refuse_link_out(path: Path, root: Path, name: Path) -> None:
    link = path / name
    if not link.is_symlink():
        return
    target = Path(os.path.realpath(link))  # a dangling link too: a write through it would create the target
    if target == root or root in target.parents:
        return
    raise RunDirError(f"run.dir {path}: {name} is a symbolic link to {target}, outside the run directory; hpctrain "
                      f"never writes or deletes through a link out of its run directory (run.overwrite=true would "
                      f"remove what is there); hint: remove the link ({link}) and hpctrain makes its own, or choose a "
                      f"run.dir on the file system it points to")


def _entries(folder: Path) -> list[str]:
    try:
        return sorted(entry.name for entry in folder.iterdir())
    except OSError as err:
        raise io_error("list", folder, err) from err


def _older_run(path: Path, names: list[str]) -> bool:
    """A run directory an hpctrain without the marker wrote. Names alone do not tell (a Lightning
    run holds a config.yaml and a model.pt too), so the contents are read: config.yaml with
    hpctrain's sections and status.json with its outcome, or hpctrain slurm's own batch script,
    or only the lock and checkpoints/ of a start that died before config.yaml."""
    # rank 0 of this very start may be claiming it while another rank checks: its lock, then
    # the marker's temporary file (atomic_write_text's ".NAME.tmp-PID"), then the marker
    claiming = {n for n in names if re.fullmatch(rf"\.{re.escape(MARKER)}\.tmp-\d+", n)}
    if LOCK in names and set(names) - claiming <= {LOCK, CHECKPOINTS}:
        return True
    if SCRIPT in names and any(line.startswith("# Written by `hpctrain slurm`")  # below its #SBATCH lines
                               for line in _head(path / SCRIPT, 4000).splitlines()):
        return True
    if CONFIG not in names or STATUS not in names:
        return False
    try:
        status = json.loads(_head(path / STATUS, 1 << 16))
        config = safe_yaml(_head(path / CONFIG, 1 << 20), str(path / CONFIG))
    except (ValueError, RecursionError):  # UserError is a ValueError: a config that is not hpctrain's
        return False
    return (isinstance(status, dict) and status.get("outcome") in _OUTCOMES
            and isinstance(status.get("time"), (int, float)) and isinstance(config, dict)
            and _SECTIONS <= set(config) and all(isinstance(config[s], dict) for s in _SECTIONS))


def _head(path: Path, limit: int) -> str:
    """The first ``limit`` bytes of a regular file as text ('' for anything else): a FIFO or a
    huge file in a foreign folder must not block or fill the memory."""
    try:
        return read_head(path, limit).decode("utf-8", errors="replace")
    except (OSError, UnsafeFileError):
        return ""


def claim_run_dir(path: Path) -> None:
    """Write the run marker (once): from now on hpctrain may write, and under run.overwrite=true
    remove, the names it lists. Rank 0, inside the run's lock."""
    marker = path / MARKER
    if marker.exists():
        return
    write_json(marker, {"written_by": "hpctrain", "marker_version": 1,
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "files": sorted(OWN_NAMES), "patterns": list(OWN_PATTERNS),
                        "note": "hpctrain writes only these names here; run.overwrite=true removes only the run "
                                "outputs among them and hpctrain's own entries of checkpoints/"})


def _marked_names(path: Path) -> set[str]:
    """The names the marker lists (an unreadable marker lists none: nothing is removed)."""
    try:
        files = json.loads(_head(path / MARKER, 1 << 20)).get("files", [])
    except (ValueError, AttributeError):
        return set()
    return {f for f in files if isinstance(f, str)} if isinstance(files, list) else set()


# ---------------------------------------------------------------- what a start does with the directory

Action = Literal["start", "continue", "extend", "replace"]


def prepare_run_dir(path: Path, overwrite: bool, resume: str = "never", train: Any = None) -> Action:
    """Create (or claim) the directory; refuse to reuse one that holds a finished run.

    An unfinished run (checkpoints, no summary.json) is continued by ``resume=auto``; with
    ``resume=never`` it is only replaced under ``run.overwrite=true``. Replacing a run removes
    its outputs and hpctrain's checkpoints (never a file hpctrain did not write), so two runs
    never mix. A finished run whose ``train`` (the new ``train`` section) may ask for more
    steps is left as it is (``extend``): the trainer resumes it, then calls
    :func:`reopen_finished_run` or raises :func:`finished_run_error`."""
    action = check_run_dir(path, overwrite, resume, train)
    try:
        path.mkdir(parents=True, exist_ok=True)
        claim_run_dir(path)
    except OSError as err:
        raise io_error("write into run.dir", path, err) from err
    if action == "replace":
        _remove_old_checkpoints(path / CHECKPOINTS)
        _remove_outputs(path)
    return action


def reopen_finished_run(path: Path, train: Any) -> None:
    """Rank 0, once the trainer has resumed a finished run and found steps left to train
    (``extend``): its summary.json goes, so the run reads as unfinished until it ends again
    (a preemption now is resumed like any other)."""
    log.info("run.dir %s: continuing the finished run from its last checkpoint (%s)", path, _extension(path, train))
    _remove_outputs(path, names=(SUMMARY,))


def finished_run_error(path: Path, resume: str) -> RunDirError:
    """The refusal of a finished run that the new config would not train one step further."""
    what = "nothing to resume" if resume != "never" else "it would be overwritten"
    return RunDirError(
        f"run.dir {path} already holds a finished run ({SUMMARY}): {what}; hint: a larger train.max_steps or "
        "train.epochs (or dropping train.max_steps) continues it, another run.dir starts a new one, "
        "run.overwrite=true replaces its outputs"
    )


def check_run_dir(path: Path, overwrite: bool, resume: str = "never", train: Any = None) -> Action:
    """The read-only part of :func:`prepare_run_dir`, safe on every rank before the process
    group exists (so all ranks fail alike instead of waiting for rank 0). Returns what the
    start does: ``start`` (nothing to continue), ``continue`` (resume an unfinished run),
    ``extend`` (a finished run, ``train`` asking for more steps), ``replace`` (run.overwrite)."""
    check_not_system_root(path)
    check_owner(path)
    check_links(path)
    finished = (path / SUMMARY).exists()
    checkpoints = path / CHECKPOINTS
    saved = checkpoints.is_dir() and _has_entries(checkpoints)
    if finished and not overwrite:
        return _finished(path, resume, train, saved)
    # run.overwrite never discards an unfinished run that resume=auto would continue: a
    # requeued job carrying overwrite=true must not lose its checkpoints on every restart.
    if saved and (finished or resume == "never"):
        if not overwrite:
            raise RunDirError(
                f"run.dir {path} holds checkpoints of an unfinished run; hint: resume=auto continues it, "
                "run.overwrite=true starts over"
            )
        return "replace"
    if finished:
        return "replace"
    return "continue" if saved and resume != "never" else "start"


def _finished(path: Path, resume: str, train: Any, saved: bool) -> Action:
    """A finished run without run.overwrite: continued when the new ``train`` section asks for
    more steps or epochs than it ran (from its last checkpoint), else refused. Its summary's
    counters only rule out what cannot train further; whether a step is left at all depends on
    the data and the batch (steps per epoch), which the trainer knows once it has resumed."""
    more = train is not None and resume != "never" and _extension(path, train) is not None
    if more and saved:
        return "extend"
    if more:
        raise RunDirError(f"run.dir {path} holds a finished run without checkpoints: it cannot be continued; "
                          "hint: choose another run.dir, or pass run.overwrite=true to replace its outputs")
    raise finished_run_error(path, resume)


def _extension(path: Path, train: Any) -> str | None:
    """How ``train`` goes past the finished run, as words for the log; None unless it raises a
    limit the run had (a larger train.max_steps, or more train.epochs, than its config.yaml
    held) beyond where it ended (its summary's steps and whole epochs). Dropping train.max_steps
    raises it too: the epochs bound the run then, as a larger train.max_steps would."""
    summary, old = _json_dict(path / SUMMARY), _old_train(path)
    steps, epochs = summary.get("steps"), summary.get("epochs")
    if not (isinstance(steps, int) and isinstance(epochs, int)) or old is None:
        return None
    old_steps, old_epochs = old
    steps_left = train.max_steps is None or train.max_steps > steps
    more_steps = train.max_steps is not None and train.max_steps > (old_steps or 0) and steps_left
    dropped = train.max_steps is None and old_steps is not None
    more_epochs = train.epochs > old_epochs
    if not (steps_left and train.epochs > epochs and (more_steps or dropped or more_epochs)):
        return None
    goal = (f"train.max_steps={train.max_steps}" if more_steps else
            f"train.epochs={train.epochs} (train.max_steps={old_steps} dropped)" if dropped else
            f"train.epochs={train.epochs}")
    return f"it ended at step {steps} after {epochs} whole epochs; now up to {goal}"


def _json_dict(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(_head(path, 1 << 22))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _old_train(path: Path) -> tuple[int | None, int] | None:
    """The finished run's (train.max_steps, train.epochs), from its config.yaml."""
    try:
        config = safe_yaml(_head(path / CONFIG, 1 << 20), str(path / CONFIG))
    except (ValueError, RecursionError):
        return None
    train = config.get("train") if isinstance(config, dict) else None
    if not isinstance(train, dict):
        return None
    max_steps, epochs = train.get("max_steps"), train.get("epochs", 1)
    if not (max_steps is None or isinstance(max_steps, int)) or not isinstance(epochs, int):
        return None
    return max_steps, epochs


def _has_entries(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError as err:  # unreadable is not empty, and not corrupt: its checkpoints may be all there is
        raise RunDirError(io_message("list", folder, err)) from err


def _own_checkpoint_entry(name: str) -> bool:
    """hpctrain's names in checkpoints/: step-N and its partial, superseded and uncommitted
    forms, best.json and the temporary files of its writes; never a name another tool chose
    (``epoch=3-step=1000.ckpt``)."""
    return (name == BEST_FILE or re.fullmatch(r"(\.partial-|superseded-|uncommitted-)?step-\d{9,}.*", name)
            is not None or re.fullmatch(r"\.(best\.json|step-\d{9,}.*)\.tmp-\d+", name) is not None)


def _remove_old_checkpoints(checkpoints: Path) -> None:
    """hpctrain's own entries of ``checkpoints/`` (a foreign file there stays). They are moved
    into one trash folder first, so a crash half-way never leaves a mix resume=auto would read:
    the whole folder in one rename when it holds only hpctrain's entries, else entry by entry,
    oldest step first (a crash then leaves only the old run's newest steps)."""
    if not checkpoints.is_dir():
        return
    names = _entries(checkpoints)
    trash = checkpoints.with_name(f".{CHECKPOINTS}.old-{os.getpid()}")
    try:
        if all(_own_checkpoint_entry(n) for n in names):
            os.replace(checkpoints, trash)
        else:
            trash.mkdir(exist_ok=True)
            for name in sorted(filter(_own_checkpoint_entry, names), key=_step_of):
                os.replace(checkpoints / name, trash / name)
        fsync_dir(checkpoints.parent)
        shutil.rmtree(trash)
    except OSError as err:
        raise RunDirError(f"run.overwrite=true: cannot remove the old {checkpoints}: {err}") from err


def _step_of(name: str) -> int:
    found = re.search(r"step-(\d{9,})", name)
    return int(found.group(1)) if found else -1


def _remove_outputs(path: Path, names: Iterable[str] = REPLACED) -> None:
    """The previous run's outputs that the marker lists (files and hpctrain's output folders);
    anything the marker does not list stays."""
    marked = _marked_names(path)
    for name in names:
        target = path / name
        if name not in marked or not (target.exists() or target.is_symlink()):
            continue
        try:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        except OSError as err:
            raise io_error(f"replace the previous run's {name} in", path, err) from err
    fsync_dir(path)


def prepare_run_dir_together(path: Path, overwrite: bool, resume: str, is_main: bool,
                             lock: RunDirLock | None = None, train: Any = None) -> None:
    """:func:`prepare_run_dir` once the process group exists: rank 0 alone changes the
    directory (``run.overwrite=true`` renames ``checkpoints/`` away) while the other ranks
    wait for its outcome, so no rank lists ``checkpoints/`` during the rename, and rank 0's
    error fails every rank with the same message. Every rank calls it. Rank 0 takes ``lock``
    first: nothing is changed in a directory another live run holds."""
    agree("preparing run.dir", lambda: _prepare_locked(path, overwrite, resume, lock, train) if is_main else None)


def _prepare_locked(path: Path, overwrite: bool, resume: str, lock: RunDirLock | None, train: Any) -> None:
    if lock is not None:
        # a full disk is a failed run (exit 1: free space and run it again), a read-only one bad input (2)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise io_error("create run.dir", path, err) from err
        try:
            lock.acquire()  # the first write into the directory: a read-only one fails here
        except OSError as err:
            raise io_error("write into run.dir", path, err) from err
    prepare_run_dir(path, overwrite, resume, train)


@contextmanager
def failure_recorded(is_main: bool, record: Callable[[str], None]) -> Iterator[None]:
    """When the block raises, rank 0 calls ``record(error)`` (the trainer: write ``status.json``
    outcome ``failed`` with the error and the step), then the error goes on: a batch script (or
    ``hpctrain slurm status``) must never read ``running`` from a run that has ended. A record
    that cannot be written (the same full disk, say) is logged, never raised over the error
    that ended the run."""
    try:
        yield
    except BaseException as err:
        if is_main:
            try:
                record(describe(err))
            except OSError as record_err:
                log.warning("%s", io_message("record the failure in", record_err.filename or "status.json",
                                             record_err))
        raise


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: what creating
    it will make, so that a run failing during set-up can remove them again."""
    missing: list[Path] = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_empty_dirs(created: list[Path]) -> None:
    """Undo a failed start: remove the directories of :func:`missing_dirs` (and empty folders
    inside them) while they hold no file. A directory with any file in it is kept as it is."""
    if not created:
        return
    for folder in sorted((p for p in created[0].rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        _rmdir_if_empty(folder)
    for folder in created:
        if not _rmdir_if_empty(folder):
            return


def _rmdir_if_empty(folder: Path) -> bool:
    """A folder this start created goes when nothing but its run marker is in it."""
    try:
        if [entry.name for entry in folder.iterdir()] == [MARKER]:
            (folder / MARKER).unlink()
        folder.rmdir()
    except OSError:  # not empty (or already gone): keep it
        return not folder.exists()
    return True
