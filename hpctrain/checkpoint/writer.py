"""Writing checkpoints: sync, async (one in flight) and two-tier (node-local first).

Every save is two phases:

1. *write*: this rank's files go to the target directory (the shared ``.partial-step-N``,
   or, in two-tier mode, a node-local directory that is then copied over), fsynced and
   hashed while written;
2. *commit*: the ranks exchange their file lists (or errors) over a dedicated gloo group,
   rank 0 writes the manifest and renames the directory, and every rank learns the
   outcome, so an error surfaces on all ranks alike, never only on one.

sync: both phases in the caller. async: the state is copied into reused CPU buffers
(the only stall), then both phases run in a background thread. two-tier: the write goes
to ``checkpoint.local_dir`` and the copy + commit always run in the background; once
committed, the node-local files are kept as ``step-N`` there (the newest only), which a
restart on this node reads instead of the shared copy when they match the manifest.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.checkpoint import checksum, layout, tensorfile
from hpctrain.checkpoint.checksum import Algorithm
from hpctrain.checkpoint.state import REPLICATED, REPLICATED_TENSORS, Snapshot, rank_file
from hpctrain.core.env import ClusterEnv
from hpctrain.core.modules import is_dtensor, local_part

log = logging.getLogger("hpctrain")


# ---------------------------------------------------------------- staging


class Stager:
    """Copies every tensor of a state tree into CPU buffers that are kept between saves.

    Re-writing touched memory is an order of magnitude faster than first-touching fresh
    pages, so after the first save a stage is a plain memcpy. Containers are rebuilt,
    so later changes to the live state cannot leak into a checkpoint being written.
    Tensors whose storage is in ``defer`` are left as live references, for a second
    pass (in the writer thread) to copy.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def stage(self, tree: Any, defer: set[int] | None = None) -> Any:
        return self._walk(tree, (), {}, defer or set())

    def _walk(self, obj: Any, path: tuple[Any, ...], memo: dict[int, Any], defer: set[int]) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:  # a tensor saved twice (tied weights) stays one storage
                memo[id(obj)] = obj if storage_ptr(obj) in defer else self._copy(obj, path)
            return memo[id(obj)]
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the type and attributes (state_dict's _metadata)
            for key, value in obj.items():
                out[key] = self._walk(value, (*path, key), memo, defer)
            return out
        if isinstance(obj, (list, tuple)):
            items = [self._walk(v, (*path, i), memo, defer) for i, v in enumerate(obj)]
            return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
        if obj is None or isinstance(obj, (int, float, str, bool, bytes)):
            return obj
        return copy.deepcopy(obj)

    def _copy(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        if is_dtensor(tensor):  # a shard: stage this rank's part, keep its place
            from torch.distributed.tensor import DTensor

            local = self._copy(local_part(tensor).detach(), path)
            return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                                      shape=tensor.shape, stride=tensor.stride())
        src = tensor.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
            self._buffers[path] = buf
        if buf.data_ptr() != src.data_ptr():  # the second pass meets first-pass copies again
            buf.copy_(src)
        return buf


def storage_ptr(tensor: torch.Tensor) -> int:
    """Where the tensor's bytes live on this rank: a DTensor's local shard (its own
    ``data_ptr()`` is 0 for every DTensor)."""
    return local_part(tensor).detach().data_ptr()


def to_cpu(tree: Any) -> Any:
    """Device tensors moved to CPU, CPU tensors untouched: sync and async files match."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu() if tree.device.type != "cpu" else tree
    if isinstance(tree, dict):
        out = copy.copy(tree)
        for key, value in tree.items():
            out[key] = to_cpu(value)
        return out
    if isinstance(tree, list):
        return [to_cpu(v) for v in tree]
    return tree


# ---------------------------------------------------------------- the writer


@dataclass
class _Written:
    """The outcome of one rank's write phase."""

    files: dict[str, dict[str, Any]]
    where: Path            # the directory holding this rank's files
    error: str | None = None
    failed_in: str | None = None  # the directory the error happened in (for the hint)


@dataclass
class SaveTiming:
    stall_s: float = 0.0   # how long the training loop was blocked
    total_s: float = 0.0   # until committed


class CheckpointWriter:
    """Writes :class:`Snapshot` objects of one run under ``root`` (RUN_DIR/checkpoints)."""

    def __init__(self, root: Path, env: ClusterEnv, *, mode: str = "sync", local_dir: str | None = None,
                 stagger_s: float = 0.0, keep_last: int = 3, keep_every: int | None = None,
                 group: Any = None, hash: str = checksum.DEFAULT) -> None:
        """``hash``: checkpoint.hash, the checksum of every file written (see :mod:`checksum`)."""
        self.root, self.env, self.mode = Path(root), env, mode
        self.algorithm = checksum.resolve(hash)
        self.local = _local_root(local_dir, self.root) if local_dir else None
        self.stagger_s, self.keep_last, self.keep_every, self.group = stagger_s, keep_last, keep_every, group
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpctrain-ckpt")
        self._pending: Future[Path] | None = None
        self._stager = Stager()
        self._staged = threading.Event()  # clear while the writer thread still copies live tensors
        self._staged.set()
        self.last = SaveTiming()
        self.last_committed: Path | None = None
        # rank 0: each committed checkpoint is handed on (the remote tier's upload queue), and the
        # local retention keeps the steps ``protect`` names (those still waiting for their upload)
        self.on_commit: Callable[[Path], None] | None = None
        self.protect: Callable[[], set[int]] = set

    # -- public

    def save(self, snap: Snapshot, *, blocking: bool = False, defer: set[int] | None = None) -> None:
        """Write ``snap``; in async / two-tier mode return before it is committed unless
        ``blocking``. Raises the error of the previous save, if it failed.

        ``defer``: storages (``data_ptr``) that stay unchanged until :meth:`wait_staged`
        returns, e.g. parameters and optimizer state until the next ``optimizer.step()``;
        async mode copies them in the writer thread instead of in the loop."""
        start = time.perf_counter()
        self.wait()
        # a view whose save runs collectives on the training process group writes in this thread only
        in_background = self.mode == "async" and not blocking and (snap.view is None or snap.view.background)
        if in_background:
            snap = _stage(snap, self._stager, defer)
            if defer:
                self._staged.clear()
            self._pending = self._pool.submit(self._stage_write_commit, snap, start, bool(defer))
        else:
            snap = _stage(snap, None)
            written = self._write(snap)
            if self.local is not None and not blocking:
                self._pending = self._pool.submit(self._commit, snap, written, start)
            else:
                self._commit(snap, written, start)
        self.last.stall_s = time.perf_counter() - start

    def wait_staged(self) -> None:
        """Block until the save in flight holds its own copy of every deferred tensor."""
        self._staged.wait()

    def wait(self) -> Path | None:
        """Block until the save in flight is committed; re-raise its error here."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else self.last_committed

    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    # -- phases

    def _stage_write_commit(self, snap: Snapshot, start: float, deferred: bool) -> Path:
        try:
            if deferred:
                snap = _stage(snap, self._stager, None)
        except Exception as err:  # still go through _commit: the other ranks wait there
            failed = _Written({}, self._target(snap.step), f"rank {self.env.rank}: staging: {err}")
            return self._commit(snap, failed, start)
        finally:
            self._staged.set()
        return self._commit(snap, self._write(snap), start)

    def _write(self, snap: Snapshot) -> _Written:
        target = self._target(snap.step)
        try:
            target.mkdir(parents=True, exist_ok=True)
            return _Written(write_files(snap, target, self.env, self.group, self.algorithm), target)
        except Exception as err:  # reported to every rank in _commit, raised there
            return _Written({}, target, f"rank {self.env.rank}: {type(err).__name__}: {err}", str(target.parent))

    def _target(self, step: int) -> Path:
        base = self.local if self.local is not None else self.root
        return layout.partial_dir(base, step)

    def _commit(self, snap: Snapshot, written: _Written, start: float) -> Path:
        final = self.root / layout.step_name(snap.step)
        partial = layout.partial_dir(self.root, snap.step)
        if written.error is None and self.local is not None:
            written = self._copy_to_shared(written, partial)
        results = _gather((written.files, written.error, written.failed_in), self.group, self.env)
        errors = [err for _, err, _ in results if err]
        outcome = None if errors else self._finish(partial, final, results, snap, time.perf_counter() - start)
        outcomes = _gather(outcome, self.group, self.env)
        failure = errors or [o for o in outcomes if o]
        if failure:
            self._discard_failed(partial, written)
            raise layout.CheckpointError(
                f"checkpoint {final} was not saved ({'; '.join(failure)}); the previous checkpoint "
                f"{self.last_committed or '(none)'} is intact; hint: check free space and permissions of "
                f"{self._where([where for _, _, where in results if where] or [str(self.root)])}")
        if self.local is not None and self.env.local_rank == 0:  # every rank of the node has copied its files
            _keep_local_copy(self.local, written.where, snap.step)
        self.last_committed = final
        self.last.total_s = time.perf_counter() - start
        if self.on_commit is not None and self.env.is_main:
            self.on_commit(final)
        return final

    def _discard_failed(self, partial: Path, written: _Written) -> None:
        """After a failed save: the shared partial (rank 0) and this node's local one (its first
        rank; every rank of the node is past writing) are removed, so neither tier fills up."""
        if self.env.is_main:
            _discard(partial)
        if self.local is not None and self.env.local_rank == 0:
            _discard(written.where)

    def _where(self, folders: list[str]) -> str:
        """The folders a save failed in, the node-local tier named as such."""
        local = str(self.local) if self.local is not None else None
        return " and ".join(f"{f} (checkpoint.local_dir, on the failing rank's node)" if f == local else f
                            for f in sorted(set(folders)))

    def remove_local_leftovers(self) -> None:
        """At start (the first rank of each node): what killed saves left in the node-local tier."""
        if self.local is not None:
            layout.remove_partials(self.local)

    def _finish(self, partial: Path, final: Path, results: list[Any], snap: Snapshot, save_s: float) -> str | None:
        """Rank 0: manifest, rename, retention. Returns an error text or None. ``save_s`` (the
        measured write time) goes into the manifest: `hpctrain slurm` sizes its USR1 lead from it."""
        if not self.env.is_main:
            return None
        files: dict[str, dict[str, Any]] = {}
        for rank_files, _, _ in results:
            files.update(rank_files)
        try:
            layout.commit(partial, final, files, {**snap.info, "save_s": round(save_s, 3)})
        except Exception as err:
            return f"commit: {type(err).__name__}: {err}"
        layout.apply_retention(self.root, self.keep_last, self.keep_every, self.protect())
        return None

    def _copy_to_shared(self, written: _Written, partial: Path) -> _Written:
        """Two-tier: node-local files -> the shared partial directory, checksums re-checked."""
        time.sleep(self.env.node_rank * self.stagger_s)  # nodes do not hit the shared FS at once
        try:
            partial.mkdir(parents=True, exist_ok=True)
            for name, entry in written.files.items():
                (partial / name).parent.mkdir(parents=True, exist_ok=True)  # a view's own subdirectories
                copied = _copy_file(written.where / name, partial / name, checksum.of_entry(entry))
                if checksum.mismatch(entry, copied, partial / name):
                    raise layout.CheckpointError(f"{partial / name}: copy differs from {written.where / name}")
            return written
        except Exception as err:
            return replace(written, error=f"rank {self.env.rank}: copy to {partial}: {type(err).__name__}: {err}",
                           failed_in=str(self.root))


# ---------------------------------------------------------------- helpers


def write_files(snap: Snapshot, target: Path, env: ClusterEnv, group: Any,
                algorithm: Algorithm | None = None) -> dict[str, dict[str, Any]]:
    """This rank's files in ``target`` (fsynced); returns their manifest entries, checksummed
    with ``algorithm`` (default: checkpoint.hash's default)."""
    algorithm = algorithm or checksum.resolve(checksum.DEFAULT)
    files = {}
    if snap.view is not None:
        files.update(_write_own(snap, target, env, group, algorithm))
    if snap.replicated is not None:
        skeleton, tensors = tensorfile.split(snap.replicated)
        files[REPLICATED_TENSORS] = tensorfile.write(target / REPLICATED_TENSORS, tensors, algorithm)
        files[REPLICATED] = layout.save_file(skeleton, target / REPLICATED, algorithm)
    files[rank_file(env.rank)] = layout.save_file(snap.per_rank, target / rank_file(env.rank), algorithm)
    return files


def _write_own(snap: Snapshot, target: Path, env: ClusterEnv, group: Any,
               algorithm: Algorithm) -> dict[str, dict[str, Any]]:
    """The view's own files (every rank its share, a collective allowed) under ``target``; each
    rank fsyncs and hashes the files it wrote (a view's own writer need not fsync)."""
    files = {}
    for path in snap.view.write(snap.own_state, target, env.rank, group):
        fsync_file(path)
        files[path.relative_to(target).as_posix()] = layout.hash_file(path, algorithm)
    return files


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stage(snap: Snapshot, stager: Stager | None, defer: set[int] | None = None) -> Snapshot:
    def move(tree: Any) -> Any:
        return stager.stage(tree, defer) if stager is not None else to_cpu(tree)

    replicated = move(snap.replicated) if snap.replicated is not None else None
    # a view's own state is written as it is (its save copies what it needs), staged only for an async save
    own = snap.own_state if stager is None or snap.own_state is None else move(snap.own_state)
    return replace(snap, replicated=replicated, per_rank=move(snap.per_rank), own_state=own)


def _gather(obj: Any, group: Any, env: ClusterEnv) -> list[Any]:
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def _discard(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning("checkpoint: could not remove the unfinished %s (%s)", path, err)


def _copy_file(src: Path, dst: Path, algorithm: Algorithm | None) -> dict[str, Any]:
    out = layout.HashingWriter(dst, algorithm)
    try:
        with open(src, "rb", buffering=0) as fh:
            while chunk := fh.read(16 << 20):
                out.write(chunk)
    except BaseException:
        out.abort()
        raise
    return out.close()


def _local_root(local_dir: str, shared_root: Path) -> Path:
    # One node-local directory may serve several runs: key it by the run's shared path.
    key = hashlib.sha256(str(shared_root.resolve()).encode()).hexdigest()[:12]
    return Path(local_dir) / f"hpctrain-{key}"


def _keep_local_copy(local: Path, partial: Path, step: int) -> None:
    """Two-tier, once step ``step`` is committed: its node-local files become ``local/step-N``
    (read by a restart on this node, see checkpointer.Copies); older copies and partials go
    (the tier exists to make saves and restarts fast, not to keep history). A newer step's
    partial (another rank of this node already writing it) stays."""
    final = local / layout.step_name(step)
    try:  # the save is committed: nothing here may fail it
        if final.exists():  # a stale copy (an earlier run at this path): the new one replaces it
            shutil.rmtree(final)
        os.replace(partial, final)
        older = [p for p in local.iterdir() if (other := layout.step_in_name(p)) is not None and other < step]
    except OSError as err:
        log.warning("checkpoint: could not keep the node-local copy %s (%s); a restart reads the shared copy",
                    final, err.strerror or err)
        return
    for path in older:
        shutil.rmtree(path, ignore_errors=True)


def default_group(env: ClusterEnv) -> Any:
    """A gloo group only for checkpoint coordination: its collectives may run in the
    writer thread without interleaving with the training loop's. Its timeout is the main
    group's (``parallel.init_timeout_s`` under hpctrain), not torch's 30-minute default: a
    rank that died mid-save fails the others as soon as a training collective would."""
    if not env.distributed or not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=job_timeout())


def job_timeout() -> datetime.timedelta | None:
    """The default process group's timeout (None: torch's default, where it cannot be read)."""
    world = dist.group.WORLD
    for device in ("cpu", "cuda"):  # the backend of a gloo group, then of an NCCL one
        try:
            timeout = world._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
        except (RuntimeError, AttributeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None
