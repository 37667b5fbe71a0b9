"""Node-local staging: copy the shards once per node to fast local disk before training.

Local rank 0 of each node copies (sha256 computed while copying, checked against the
manifest, each file fsynced and renamed durably) and writes a marker last; the other ranks
wait for the marker, or learn of a failure within a second (:mod:`hpctrain.data.nodeonce`).
A copy is reused only when its marker names the same source manifests and every staged
file still has the size, mtime and (recorded at copy time) sha256 the marker lists, so a
requeued job does not copy again.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpctrain.core.atomic import atomic_write_bytes, replace_durably
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import RunError, UserError
from hpctrain.core.safe_open import TooLargeError, UnsafeFileError, WrongSizeError, open_regular
from hpctrain.data.errors import ShardError
from hpctrain.data.manifest import (
    JSON_LIMIT,
    data_dir,
    load_manifest,
    manifest_path,
    parse_json,
    plain_name,
    read_regular,
)
from hpctrain.data.nodeonce import once_per_node
from hpctrain.data.remote import download_verified, open_store, remote_of

log = logging.getLogger("hpctrain")
CHUNK = 8 * 2**20


class StageError(RunError):
    """Staging failed (copy mismatch, no space, timeout); the message names the file."""


class StageDirError(UserError, StageError):
    """data.stage_dir cannot be used (not a directory, not writable): fix the setting, exit 2."""


def resolve_stage_dir(setting: str | None, environ: Mapping[str, str] | None = None) -> Path | None:
    """data.stage_dir: a path, ``off``, or unset = ``$SLURM_TMPDIR`` when the job has one.

    Reading SLURM_TMPDIR here, and only here, keeps the default where users look for it.
    """
    if setting is not None:
        return None if setting.lower() in ("off", "none", "") else Path(setting)
    env = os.environ if environ is None else environ
    tmp = env.get("SLURM_TMPDIR")
    return Path(tmp) if tmp else None


def stage_target(source: Path, stage_dir: Path) -> Path:
    """A per-source folder, so two datasets staged on one node never collide."""
    tag = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:10]
    return stage_dir / f"hpctrain-shards-{source.resolve().name}-{tag}"


def _marker(target: Path) -> Path:
    return target / ".staged.json"


def _wanted(source: Path, splits: Sequence[str]) -> dict[str, str]:
    """Source manifest sha256 per split present in the source."""
    out = {}
    for split in splits:
        path = manifest_path(source, split)
        if path.is_file():  # bounded, non-blocking: a FIFO or device named like a manifest is refused
            out[split] = hashlib.sha256(read_regular(path, "manifest")).hexdigest()
    if not out:
        raise ShardError(f"no manifest for splits {list(splits)} in {source}; "
                         f"hint: hpctrain data shard SOURCE {source}")
    return out


def is_current(source: Path, target: Path, splits: Sequence[str]) -> bool:
    """Whether ``target`` holds a verified copy of ``source``'s splits. Never raises for what it
    finds in ``target`` (the waiting ranks poll it): a broken marker only means "copy again"."""
    marker = _marker(target)
    if not marker.is_file():
        return False
    try:
        staged = parse_json(read_regular(marker, "stage marker"), "stage marker", marker)
        if not isinstance(staged, dict) or staged.get("manifests") != _wanted(source, splits):
            return False
    except ShardError:
        return False
    files = staged.get("files")
    # only plain names: a marker naming ../x must not make a file outside the stage directory count
    return (isinstance(files, dict) and bool(files)
            and all(plain_name(name) and _unchanged(target / name, rec) for name, rec in files.items()))


def _unchanged(path: Path, record: Any) -> bool:
    """The staged file is the one the marker describes: same size and mtime as when it was
    copied and verified (a marker from an older version, without them, is not trusted)."""
    if not isinstance(record, dict) or not path.is_file():
        return False
    st = path.stat()
    return bool(st.st_size == record.get("bytes") and st.st_mtime_ns == record.get("mtime_ns"))


def _open_source(src: Path, size: int | None, limit: int | None) -> io.FileIO:
    """A descriptor of ``src``, opened without blocking and refused unless it is a regular file of
    the declared ``size`` (or at most ``limit`` bytes): a FIFO would stall the copy, a device or a
    sparse giant would stream into the local disk before the sha256 could tell."""
    try:
        fh, _ = open_regular(src, size=size, limit=limit)
    except OSError as err:
        raise ShardError(f"cannot stage {src}: {err.strerror}; hint: hpctrain data verify {src.parent}") from err
    except UnsafeFileError as err:
        raise ShardError(f"cannot stage {src}: it {_what_is_wrong(err, size, limit)}; hint: hpctrain data verify "
                         f"{src.parent}") from err
    return fh


def _what_is_wrong(err: UnsafeFileError, size: int | None, limit: int | None) -> str:
    if isinstance(err, WrongSizeError):
        return f"is {err.size} bytes, the manifest says {size}"
    if isinstance(err, TooLargeError):
        return f"is {err.size} bytes, more than the {limit} it can be"
    return "is not a regular file (a FIFO, device or directory)"


def copy_verified(src: Path, dst: Path, sha256: str | None, size: int | None = None,
                  limit: int | None = None) -> dict[str, Any]:
    """Copy under a temporary name, hashing the bytes written; fsync; rename (and fsync the
    directory) only when the hash matches the manifest. Returns what the marker records.
    ``size``/``limit``: the source's declared size, or its largest, checked before copying."""
    source = _open_source(src, size, limit)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    sha = hashlib.sha256()
    copied = 0
    try:
        with source as fin, open(tmp, "wb") as fout:
            while block := fin.read(CHUNK):
                sha.update(block)
                fout.write(block)
                copied += len(block)
            fout.flush()
            os.fsync(fout.fileno())  # on the local disk before anyone reads it, or a crash loses it
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise StageError(f"cannot copy {src} to {dst}: {err}; hint: check the stage directory, or "
                         "data.stage_dir=off") from err
    if sha256 is not None and sha.hexdigest() != sha256:
        tmp.unlink(missing_ok=True)
        raise StageError(f"staged copy of {src} has sha256 {sha.hexdigest()[:12]}..., the manifest says "
                         f"{sha256[:12]}...; hint: hpctrain data verify {src.parent}")
    replace_durably(tmp, dst)
    return {"bytes": copied, "sha256": sha.hexdigest(), "mtime_ns": dst.stat().st_mtime_ns}


def copy_split(source: Path, target: Path, split: str) -> dict[str, dict[str, Any]]:
    """Copy one split's shards and indexes, then its manifest; returns {file: record}.

    The tars may live apart from the manifest (``data_dir``: tars indexed where they could
    not be written); the staged manifest then names its own copies."""
    path = manifest_path(source, split)
    # checked as the loader checks it: plain shard names, indexes beside the manifest or the tars, so
    # a crafted manifest can neither read from outside data.path nor write outside the stage directory
    manifest = load_manifest(source, split)
    tars = data_dir(source, manifest)
    files: dict[str, dict[str, Any]] = {}
    rec = remote_of(manifest)
    store = open_store(*rec) if rec is not None else None  # one client for the split's shards
    for shard in manifest["shards"]:
        if store is not None:  # shards on object storage: downloaded, sha256-checked, into the node-local cache
            files[shard["name"]] = download_verified(store, shard, target / shard["name"])
        else:
            files[shard["name"]] = copy_verified(tars / shard["name"], target / shard["name"], shard["sha256"],
                                                 size=shard["bytes"])
        index = Path(shard["index"]).name
        index_sha = shard.get("index_sha256")  # optional: older manifests lack it
        files[index] = copy_verified(source / shard["index"], target / index,
                                     index_sha if isinstance(index_sha, str) else None, limit=JSON_LIMIT.bytes())
    moved = "data_dir" in manifest or "remote" in manifest
    if moved or any(Path(s["index"]).is_absolute() for s in manifest["shards"]):
        manifest.pop("data_dir", None)
        manifest.pop("remote", None)  # the staged copy is read locally
        manifest["shards"] = [{**s, "index": Path(s["index"]).name} for s in manifest["shards"]]
        atomic_write_bytes(target / path.name, json.dumps(manifest, indent=1).encode())
        st = (target / path.name).stat()
        files[path.name] = {"bytes": st.st_size, "sha256": None, "mtime_ns": st.st_mtime_ns}
    else:
        files[path.name] = copy_verified(path, target / path.name, None)
    return files


def stage_local(source: Path, target: Path, splits: Sequence[str]) -> dict[str, Any]:
    """The copy itself (local rank 0 only); returns what the marker records."""
    wanted = _wanted(source, splits)
    need = sum(shard["bytes"] for s in wanted for shard in load_manifest(source, s)["shards"])
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StageDirError(f"cannot create the stage directory {target}: {err}; hint: data.stage_dir=PATH on a "
                         "writable local disk, or data.stage_dir=off") from err
    free = shutil.disk_usage(target).free
    if need > free:
        raise StageError(f"staging {need / 2**30:.2f} GiB into {target}, but only {free / 2**30:.2f} GiB are free; "
                         "hint: data.stage_dir=off or a larger local disk")
    _marker(target).unlink(missing_ok=True)  # an interrupted copy must not look current
    start, files = time.perf_counter(), {}
    for split in wanted:
        files.update(copy_split(source, target, split))
    seconds = time.perf_counter() - start
    total = sum(rec["bytes"] for rec in files.values())
    log.info("staged %d files, %.1f MB, from %s to %s in %.2f s (%.0f MB/s)", len(files), total / 1e6, source,
             target, seconds, total / 1e6 / max(seconds, 1e-9))
    record = {"source": str(source.resolve()), "manifests": wanted, "files": files, "bytes": total,
              "seconds": seconds, "mb_per_s": total / 1e6 / max(seconds, 1e-9)}
    atomic_write_bytes(_marker(target), json.dumps(record, indent=1).encode())
    return record


def stage_shards(source: str | Path, stage_dir: Path | None, env: ClusterEnv, splits: Sequence[str],
                 timeout_s: float = 3600.0) -> Path:
    """Return the directory to read shards from: ``source`` itself, or a verified node-local copy.

    Local rank 0 of each node copies; the node's other ranks wait for the marker. When the
    copy fails, every rank raises within seconds, the waiting ones with local rank 0's message.
    """
    source = Path(source)
    if stage_dir is None:
        return source
    target = stage_target(source, stage_dir)

    def work() -> None:
        if is_current(source, target, splits):
            log.info("reusing the staged shards in %s", target)
        else:
            stage_local(source, target, splits)

    once_per_node("staging the shards", env, work, lambda: is_current(source, target, splits), timeout_s)
    return target
