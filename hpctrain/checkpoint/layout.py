"""On-disk layout and the commit protocol.

``RUN_DIR/checkpoints/step-000001234/`` holds the state files and ``manifest.json``.
A checkpoint is written into ``.partial-step-000001234/``; every file is fsynced, the
manifest (names, sizes, checksums, world size, step, versions) is written last, then the
directory is renamed to its final name and the parent directory is fsynced. A
``step-*`` directory therefore always holds a complete checkpoint, and resume only
considers those whose manifest checks out.

What a killed save leaves (``.partial-*`` directories, ``.NAME.tmp-PID`` files) is removed at the
next start, by name, with a log line; a ``step-*`` directory without a manifest (a partial copy,
a deleted manifest) that is in the way of a save is kept as ``uncommitted-step-*``. A file that
exists but cannot be read (permissions, I/O error) raises :class:`UnreadableCheckpointError`:
it is never called corrupt, never skipped, never deleted.
"""

from __future__ import annotations

import errno
import glob
import json
import logging
import math
import os
import platform
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hpctrain._version import __version__
from hpctrain.checkpoint import checksum, confine
from hpctrain.checkpoint.checksum import Algorithm
from hpctrain.checkpoint.confine import CheckpointError
from hpctrain.core.atomic import atomic_write_text, replace_durably
from hpctrain.core.errors import EXIT_RUN_FAILED, EXIT_USER_ERROR, UserError
from hpctrain.core.rundir import BEST_FILE

log = logging.getLogger("hpctrain")

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
PARTIAL_PREFIX = ".partial-"
_NAME = re.compile(r"^step-(\d{9,})$")
_STEP_IN_NAME = re.compile(r"step-(\d{9,})$")  # step-N, .partial-step-N, superseded-step-N
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")  # core.atomic.atomic_open's temporary files
UNCOMMITTED_PREFIX = "uncommitted-"


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint's file or directory exists but cannot be read: not corrupt, so never
    skipped and never suggested for deletion. Exit 2 where the path is the problem (permission
    denied, a file where a folder belongs), 1 where the storage is (an I/O error)."""

    def __init__(self, message: str, exit_code: int = EXIT_RUN_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


_PATH_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR})


def unreadable(path: Path, err: OSError, what: str = "read") -> UnreadableCheckpointError:
    """The error for an OSError met while reading ``path`` (names it, suggests no deletion)."""
    reason = err.strerror or str(err)
    code = EXIT_USER_ERROR if err.errno in _PATH_ERRNOS else EXIT_RUN_FAILED
    return UnreadableCheckpointError(
        f"{path} cannot be {what} ({reason}): unreadable here, which says nothing about its contents; it was left "
        "as it is; "
        f"hint: check its permissions (`ls -ld {path}`) and the file system, then start again", code)


class NoCheckpointError(UserError, CheckpointError):
    """A path given by the user (resume=PATH, ``hpctrain ckpt ...``) holds no committed checkpoint: exit 2."""


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def partial_dir(root: Path, step: int) -> Path:
    return root / f"{PARTIAL_PREFIX}{step_name(step)}"


def step_of(path: Path) -> int | None:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------- writing files


class HashingWriter:
    """A binary file that is checksummed (:class:`checksum.TreeHash`, with ``algorithm``, default
    checkpoint.hash's default) while it is written and fsynced on close. For the small files
    (``torch.save`` of skeletons, per-rank state, copies); tensor bytes go through tensorfile.write."""

    def __init__(self, path: Path, algorithm: Algorithm | None = None) -> None:
        self.path = path
        self._digest = checksum.TreeHash(algorithm or checksum.resolve(checksum.DEFAULT))
        self._fh: IO[bytes] = open(path, "wb")
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._digest.update(bytes(view))  # a copy: the caller may reuse its buffer
        self._fh.write(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> dict[str, Any]:
        """fsync, close, and return the manifest entry ``{size, <algorithm's key>}``."""
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
        finally:
            self._fh.close()
        return self._digest.entry(self.size)

    def abort(self) -> None:
        self._fh.close()


def save_file(obj: Any, path: Path, algorithm: Algorithm | None = None) -> dict[str, Any]:
    """``torch.save`` to ``path`` (fsynced); returns its manifest entry."""
    import torch

    writer = HashingWriter(path, algorithm)
    try:
        torch.save(obj, writer)  # type: ignore[arg-type]
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def hash_file(path: Path, algorithm: Algorithm | None = None, root: Path | None = None) -> dict[str, Any]:
    """Manifest entry of a file already on disk (DCP's files, verification); only a regular
    file inside ``root`` (when given) is read."""
    return checksum.hash_file(path, algorithm, root)


# ---------------------------------------------------------------- commit


def versions() -> dict[str, str]:
    import torch

    return {"hpctrain": __version__, "torch": torch.__version__, "python": platform.python_version()}


def commit(partial: Path, final: Path, files: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    """Write the manifest last, then rename ``partial`` to ``final`` and fsync the parent. A
    ``final`` without a manifest (never committed, or its manifest deleted) is moved aside."""
    if final.exists() and not (final / MANIFEST).is_file():
        move_aside(final, UNCOMMITTED_PREFIX, "it has no manifest: never committed, or a partial copy")
    if final.exists():
        raise CheckpointError(f"checkpoint {final} already exists; hint: two runs share run.dir, "
                              "or the step counter went back")
    manifest = {"format_version": FORMAT_VERSION, **info, "versions": versions(), "checksum": checksum_doc(files),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": files}
    atomic_write_text(partial / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")  # fsyncs partial/
    replace_durably(partial, final)


def checksum_doc(files: dict[str, dict[str, Any]]) -> str:
    """What the manifest's checksums are, for a reader without hpctrain (every algorithm the entries use)."""
    used = {checksum.of_entry(entry) for entry in files.values()}
    return "; ".join(sorted(a.doc for a in used if a is not None))


def move_aside(path: Path, prefix: str, why: str) -> Path:
    """Rename ``path`` to ``PREFIX + its name`` (``.2``, ``.3``, ... when taken), logged; nothing is
    deleted. Raises CheckpointError when the rename fails."""
    target = path.with_name(f"{prefix}{path.name}")
    for n in range(2, 10_000):
        if not target.exists():
            break
        target = path.with_name(f"{prefix}{path.name}.{n}")
    try:
        replace_durably(path, target)
    except OSError as err:
        raise CheckpointError(f"{path} is in the way ({why}) and cannot be moved aside to {target.name}: "
                              f"{err.strerror or err}; hint: check the permissions of {path.parent}") from err
    log.warning("checkpoint: %s is in the way (%s): kept as %s", path, why, target.name)
    return target


def remove_partials(root: Path) -> None:
    """Leftovers of a crashed save are never loaded; clear them (logged) so names can be reused."""
    if not root.is_dir():
        return
    for path in root.glob(f"{PARTIAL_PREFIX}*"):
        if _remove_tree(path):
            log.info("checkpoint: removed %s, left by an interrupted save", path)


def remove_stale_temps(folder: Path, name: str) -> None:
    """The ``.NAME.tmp-PID`` files (hpctrain's atomic writers') of ``folder/name`` whose process
    is gone (killed mid-write), logged."""
    try:
        paths = list(Path(folder).glob(f".{glob.escape(name)}.tmp-*"))
    except OSError:  # an unreadable folder is reported by whoever needs it
        return
    for path in paths:
        match = _TEMP.match(path.name)
        if match is None or _alive(int(match["pid"])) or not path.is_file():
            continue
        try:
            path.unlink()
            log.info("removed %s, left by a write that was interrupted", path)
        except OSError as err:
            log.warning("could not remove %s, left by an interrupted write (%s)", path, err.strerror or err)


def _alive(pid: int) -> bool:
    """Is ``pid`` a running process on this host (its temporary file may still be written)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def step_in_name(path: Path) -> int | None:
    """The step of ``step-N``, ``.partial-step-N`` and the like."""
    match = _STEP_IN_NAME.search(path.name)
    return int(match.group(1)) if match else None


def _remove_tree(path: Path) -> bool:
    try:
        shutil.rmtree(path)
        return True
    except OSError as err:  # retention and clean-up never end a run
        log.warning("checkpoint: could not delete %s (%s); delete it by hand", path, err)
        return False


# ---------------------------------------------------------------- reading


@dataclass
class Found:
    path: Path
    step: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


MAX_MANIFEST = 64 << 20  # ~300 bytes an entry: far beyond the files of any real checkpoint
# Keys a manifest may hold and the types they must have where present (readers use them as such).
_INFO_TYPES: dict[str, type] = {"format": str, "world_size": int, "step": int, "epoch": int, "created": str,
                                "format_version": int, "run_id": str}


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, read as untrusted input: a regular file inside
    ``path``, bounded in size, checked for the types every reader relies on
    (:func:`check_manifest`). Anything else is a :class:`CheckpointError` naming the key."""
    file = Path(path) / MANIFEST
    try:
        if confine.check_regular(file, Path(path)) > MAX_MANIFEST:  # never a FIFO, a device or a huge file
            raise CheckpointError(f"{file} holds more than the {MAX_MANIFEST:,} bytes a manifest ever holds "
                                  "(crafted or corrupted)")
        data = json.loads(file.read_text())
    except confine.MissingFileError:
        raise CheckpointError(f"{file} is missing: {path} is not a committed checkpoint") from None
    except OSError as err:
        raise unreadable(file, err) from None
    except RecursionError:
        raise CheckpointError(f"{file} nests too deep to be a manifest (crafted or corrupted)") from None
    except ValueError as err:  # UnicodeDecodeError included
        raise CheckpointError(f"{file} is not valid JSON ({err}) (corrupted)") from None
    check_manifest(data, file)
    return data


def check_manifest(data: Any, file: Path) -> None:
    """Raise :class:`CheckpointError` unless ``data`` is a manifest: ``files`` maps names inside
    the checkpoint to entries with an integer ``size`` (and a string checksum where the entry
    names a known one), and the other keys readers use have their types."""
    hint = "hint: the manifest is corrupted or crafted; `hpctrain ckpt verify` the older checkpoints"
    if not isinstance(data, dict) or "files" not in data:
        raise CheckpointError(f"{file} is not an hpctrain checkpoint manifest (no 'files')")
    files = data["files"]
    if not isinstance(files, dict):
        raise CheckpointError(f"{file}: 'files' is a {_type(files)}, not an object of file entries; {hint}")
    for name, entry in files.items():
        confine.member(file.parent, name)
        _not_a_folder_too(files, name, file)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{file}: files[{name!r}] is a {_type(entry)} ({_short(entry)}), not an object "
                                  f"with 'size' and a checksum; {hint}")
        size = entry.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"{file}: files[{name!r}].size is {_short(size)}, not a byte count; {hint}")
        algorithm = checksum.of_entry(entry)
        if algorithm is not None and not isinstance(entry[algorithm.key], str):
            raise CheckpointError(f"{file}: files[{name!r}].{algorithm.key} is {_short(entry[algorithm.key])}, not "
                                  f"a hex digest; {hint}")
    for key, kind in _INFO_TYPES.items():
        if key in data and not (_is_int(data[key]) if kind is int else isinstance(data[key], kind)):
            raise CheckpointError(f"{file}: {key!r} is {_short(data[key])}, not a {kind.__name__}; {hint}")
    named = step_in_name(file.parent)
    if named is not None and "step" in data and data["step"] != named:
        # a resume would report one step and continue from another, on every requeue
        raise CheckpointError(f"{file}: the checkpoint is named {file.parent.name} but its manifest says step "
                              f"{data['step']} (renamed, or crafted); {hint}")


def _not_a_folder_too(files: dict[str, Any], name: str, file: Path) -> None:
    """``x`` and ``x/y`` in one manifest: ``x`` cannot be a file and a folder (crafted)."""
    parts = name.split("/")
    for n in range(1, len(parts)):
        folder = "/".join(parts[:n])
        if folder in files:
            raise confine.RefusedFileError(f"{file} names both {folder!r} and {name!r}: {folder!r} cannot be a file "
                                           f"and a folder (crafted or damaged): refused")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type(value: Any) -> str:
    names: dict[type, str] = {list: "list", dict: "object", str: "string"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else _type(value)
    return text if len(text) <= 60 else text[:57] + "..."


Hasher = Callable[[Path, Algorithm], dict[str, Any]]


def verify(path: Path, hasher: Hasher | None = None) -> list[str]:
    """Problems with a checkpoint directory (empty list = intact). A file that exists but cannot
    be read raises :class:`UnreadableCheckpointError` instead: that is no proof of corruption;
    nor is a checksum whose hash is not installed here (exit 2, with the hint)."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except UnreadableCheckpointError:
        raise
    except CheckpointError as err:
        return [str(err)]
    problems = []
    for name, entry in sorted(manifest["files"].items()):
        file = path / name
        try:
            problem = _check_file(path, file, entry, hasher or _confined_hash(path))
        except CheckpointError as err:  # outside the directory, not a regular file, missing
            problem = str(err)
        except OSError as err:
            raise unreadable(file, err) from None
        except checksum.ChecksumUnavailableError as err:
            raise UnreadableCheckpointError(f"{file} cannot be verified here: {err}", EXIT_USER_ERROR) from None
        if problem:
            problems.append(problem)
    return problems


def _confined_hash(root: Path) -> Hasher:
    return lambda file, algorithm: hash_file(file, algorithm, root)


def _check_file(root: Path, file: Path, entry: dict[str, Any], hasher: Hasher) -> str | None:
    """Why ``file`` does not match its entry (None: it does). Its size is compared (``stat``
    of a regular file inside ``root``) before a byte is read: nothing about a file outside
    the checkpoint, its size included, is ever read or shown."""
    got: dict[str, Any] = {"size": confine.check_regular(file, root)}
    if got["size"] == entry.get("size") and got["size"] > confine.MAX_WHOLE and file.parent == root \
            and file.suffix == ".pt":
        # a crafted size: never hashed for hours
        return (f"{file} holds {got['size']:,} bytes, more than the {confine.MAX_WHOLE:,} a checkpoint's skeleton "
                "or per-rank state ever holds (a resume reads it whole): refused before reading")
    algorithm = checksum.of_entry(entry)
    if got["size"] == entry.get("size") and algorithm is not None:  # hashed only where the size agrees
        got = hasher(file, algorithm)
    return checksum.mismatch(entry, got, file)


def committed(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories under ``root``, oldest first (not yet verified). An
    unreadable ``root`` raises :class:`UnreadableCheckpointError`."""
    try:
        if not Path(root).is_dir():
            return []
        found = [(step_of(p), p) for p in Path(root).iterdir() if p.is_dir()]
        return sorted((s, p) for s, p in found if s is not None and (p / MANIFEST).is_file())
    except OSError as err:
        raise unreadable(Path(root), err, "listed") from None


def run_id_of(root: Path) -> str | None:
    """The run id the newest of ``root``'s committed checkpoints that names one carries (None: none
    does, e.g. written before runs had ids): whose run directory this is."""
    for _, path in reversed(committed(root)[-5:]):  # the newest few: a run's id does not change
        try:
            found = read_manifest(path).get("run_id")
        except CheckpointError:
            continue  # corrupt or crafted: says nothing about whose it is
        if isinstance(found, str):
            return found
    return None


def newest_valid(root: Path) -> Found | None:
    """The newest checkpoint that verifies; corrupt ones are reported by name and skipped."""
    for step, path in reversed(committed(root)):
        problems = verify(path)
        if not problems:
            return Found(path, step, [])
        log.warning("checkpoint %s is corrupt and is skipped: %s", path, "; ".join(problems))
    return None


def candidates(spec: str, root: Path) -> list[Path]:
    """Checkpoints to try for ``resume=spec``, newest first, not yet verified (resume
    verifies each while loading it). ``auto``: the run's own (maybe none); a PATH: that
    checkpoint, or the committed ones of a run directory or a checkpoints/ directory."""
    if spec == "auto":
        return [p for _, p in reversed(committed(root))]
    path = Path(spec)
    if (path / MANIFEST).is_file():
        return [path]
    for where in (checkpoints_dir(path), path):
        found = [p for _, p in reversed(committed(where))]
        if found:
            return found
    raise NoCheckpointError(f"resume={spec}: {path} holds no committed checkpoint (no {MANIFEST}); "
                          "hint: `hpctrain ckpt list RUN_DIR`, or resume=auto")


def resolve(path: str | Path) -> Path:
    """``PATH`` given by the user: a checkpoint, a run dir, or a checkpoints/ dir -> newest valid."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    for root in (checkpoints_dir(path), path):
        found = newest_valid(root)
        if found is not None:
            return found.path
    raise NoCheckpointError(f"{path} holds no committed checkpoint (no {MANIFEST}); hint: `hpctrain ckpt list RUN_DIR`")


def set_aside(root: Path, after_step: int) -> None:
    """Resuming from step s: checkpoints past s (corrupt, or of an abandoned future) are
    renamed ``superseded-step-N`` so the resumed run can commit those steps again."""
    for step, path in committed(root):
        if step <= after_step:
            continue
        target = path.with_name(f"superseded-{path.name}")
        _remove_tree(target) if target.exists() else None
        try:
            replace_durably(path, target)
            log.warning("checkpoint %s is past the resume point (step %d): kept as %s", path, after_step, target.name)
        except OSError as err:
            log.warning("checkpoint: could not rename %s (%s); the resumed run cannot commit step %d", path, err, step)


# ---------------------------------------------------------------- retention


def to_delete(steps: list[int], keep_last: int, keep_every: int | None, protect: set[int]) -> list[int]:
    """Steps that retention removes: not among the newest ``keep_last``, not a multiple of
    ``keep_every``, not protected (best, the newest finite), never the newest."""
    keep = set(steps[-max(1, keep_last):]) | protect
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def apply_retention(root: Path, keep_last: int, keep_every: int | None, keep: set[int] | None = None) -> None:
    """``keep``: steps kept whatever their age (the remote tier's uploads still waiting). The
    writer and the remote tier's uploader both apply it, in their own threads: one at a time."""
    with _RETENTION:
        _apply_retention(root, keep_last, keep_every, keep)


_RETENTION = threading.Lock()


def _apply_retention(root: Path, keep_last: int, keep_every: int | None, keep: set[int] | None) -> None:
    entries = committed(root)
    protect = ({best_step(root), newest_finite(entries)} - {None}) | (keep or set())
    doomed = to_delete([s for s, _ in entries], keep_last, keep_every, protect)  # type: ignore[arg-type]
    for step, path in entries:
        if step not in doomed:
            continue
        # Rename first: a half-deleted directory must never look committed.
        trash = path.with_name(f"{PARTIAL_PREFIX}deleting-{path.name}")
        try:
            replace_durably(path, trash)
        except OSError as err:
            log.warning("checkpoint retention: could not remove %s (%s); it stays", path, err)
            continue
        _remove_tree(trash)


def newest_finite(entries: list[tuple[int, Path]]) -> int | None:
    """The newest of ``entries`` (committed(), oldest first) whose manifest says its weights were
    checked finite when saved (every checkpoint hpctrain writes now; older ones say nothing)."""
    for step, path in reversed(entries):
        try:
            if read_manifest(path).get("finite") is True:
                return step
        except CheckpointError:
            continue  # unreadable or crafted: not known to be finite
    return None


def best_step(root: Path) -> int | None:
    """The step best.json names; None without one, or when its value is not finite (a nan
    val_loss is no best: an older version could record one)."""
    try:
        record = json.loads((Path(root) / BEST_FILE).read_text())
        value = record.get("value", 0.0)
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return int(record["step"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
