"""On-disk layout and the commit protocol.

``RUN_DIR/checkpoints/step-000001234/`` holds the state files and ``manifest.json``.
A checkpoint is written into ``.partial-step-000001234/``; every file is fsynced, the
manifest (names, sizes, checksums, world size, step, versions) is written last, then the
directory is renamed to its final name and the parent directory is fsynced. A
``step-*`` directory therefore always holds a complete checkpoint, and resume only
considers those whose manifest checks out.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hpctrain._version import __version__
from hpctrain.errors import RunError, UserError
from hpctrain.rundir import atomic_write_text, replace_durably

log = logging.getLogger("hpctrain")

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
PARTIAL_PREFIX = ".partial-"
BEST_FILE = "best.json"
# The manifest's checksum key; tensorfile.DIGEST says the same, but tensorfile loads torch, and
# `hpctrain ckpt list` on a login node reads manifests without it (tests/test_imports.py checks both).
DIGEST = "sha256_tree"
CHECKSUM_DOC = f"{DIGEST}: sha256 of the concatenated sha256 digests of the file's consecutive 64 MiB pieces"
_NAME = re.compile(r"^step-(\d{9,})$")


class CheckpointError(RunError):
    """A checkpoint cannot be written or read; the message names the file and a hint."""


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
    """A binary file that is checksummed (:class:`TreeHash`) while it is written and
    fsynced on close. For the small files (``torch.save`` of skeletons, per-rank state,
    copies); tensor bytes go through tensorfile.write."""

    def __init__(self, path: Path) -> None:
        from hpctrain.checkpoint.tensorfile import TreeHash  # writing: torch is loaded anyway

        self.path = path
        self._fh: IO[bytes] = open(path, "wb")
        self._digest = TreeHash()
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
        """fsync, close, and return the manifest entry ``{size, sha256}``."""
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
        finally:
            self._fh.close()
        return {"size": self.size, DIGEST: self._digest.hexdigest()}

    def abort(self) -> None:
        self._fh.close()


def save_file(obj: Any, path: Path) -> dict[str, Any]:
    """``torch.save`` to ``path`` (fsynced); returns its manifest entry."""
    import torch

    writer = HashingWriter(path)
    try:
        torch.save(obj, writer)  # type: ignore[arg-type]
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def hash_file(path: Path) -> dict[str, Any]:
    """Manifest entry of a file already on disk (DCP's files, verification)."""
    from hpctrain.checkpoint import tensorfile

    return tensorfile.hash_file(path)


# ---------------------------------------------------------------- commit


def versions() -> dict[str, str]:
    import torch

    return {"hpctrain": __version__, "torch": torch.__version__, "python": platform.python_version()}


def commit(partial: Path, final: Path, files: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    """Write the manifest last, then rename ``partial`` to ``final`` and fsync the parent."""
    if final.exists():
        raise CheckpointError(f"checkpoint {final} already exists; hint: two runs share run.dir, "
                              "or the step counter went back")
    manifest = {"format_version": FORMAT_VERSION, **info, "versions": versions(), "checksum": CHECKSUM_DOC,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": files}
    atomic_write_text(partial / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")  # fsyncs partial/
    replace_durably(partial, final)


def remove_partials(root: Path) -> None:
    """Leftovers of a crashed save are never loaded; clear them so names can be reused."""
    if not root.is_dir():
        return
    for path in root.glob(f"{PARTIAL_PREFIX}*"):
        _remove_tree(path)


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


def read_manifest(path: Path) -> dict[str, Any]:
    file = Path(path) / MANIFEST
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: {path} is not a committed checkpoint") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file} cannot be read ({err})") from None
    if not isinstance(data, dict) or "files" not in data:
        raise CheckpointError(f"{file} is not an hpctrain checkpoint manifest (no 'files')")
    return data


def verify(path: Path, hasher: Callable[[Path], dict[str, Any]] = hash_file) -> list[str]:
    """Problems with a checkpoint directory (empty list = intact)."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except CheckpointError as err:
        return [str(err)]
    problems = []
    for name, entry in sorted(manifest["files"].items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{file}: missing")
            continue
        size = file.stat().st_size
        if size != entry["size"]:
            problems.append(f"{file}: size {size} != {entry['size']} in the manifest (truncated or overwritten)")
            continue
        if hasher(file)[DIGEST] != entry.get(DIGEST):
            problems.append(f"{file}: checksum ({DIGEST}) does not match the manifest (corrupted)")
    return problems


def committed(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories under ``root``, oldest first (not yet verified)."""
    if not Path(root).is_dir():
        return []
    found = [(step_of(p), p) for p in Path(root).iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None and (p / MANIFEST).is_file())


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
    ``keep_every``, not protected (best), never the newest."""
    keep = set(steps[-max(1, keep_last):]) | protect
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def apply_retention(root: Path, keep_last: int, keep_every: int | None) -> None:
    entries = committed(root)
    protect = {best_step(root)} - {None}
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


def best_step(root: Path) -> int | None:
    try:
        return int(json.loads((Path(root) / BEST_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
