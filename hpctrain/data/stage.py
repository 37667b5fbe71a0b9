"""Node-local staging: copy the shards once per node to fast local disk before training.

Local rank 0 of each node copies (sha256 computed while copying, checked against the
manifest) and writes a marker last; the other ranks wait for the marker. A copy whose
marker matches the source manifest is reused, so a requeued job does not copy again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpctrain.data.shards import ShardError, atomic_write_bytes, manifest_path
from hpctrain.env import ClusterEnv
from hpctrain.errors import RunError

log = logging.getLogger("hpctrain")
CHUNK = 8 * 2**20


class StageError(RunError):
    """Staging failed (copy mismatch, no space, timeout); the message names the file."""


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
        if path.is_file():
            out[split] = hashlib.sha256(path.read_bytes()).hexdigest()
    if not out:
        raise ShardError(f"no manifest for splits {list(splits)} in {source}; "
                         f"hint: hpctrain data shard SOURCE {source}")
    return out


def is_current(source: Path, target: Path, splits: Sequence[str]) -> bool:
    marker = _marker(target)
    if not marker.is_file():
        return False
    try:
        staged = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    if staged.get("manifests") != _wanted(source, splits):
        return False
    return all((target / name).is_file() and (target / name).stat().st_size == size
               for name, size in staged.get("files", {}).items())


def copy_verified(src: Path, dst: Path, sha256: str | None) -> int:
    """Copy under a temporary name, hashing on the way; rename only when the hash matches."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    sha = hashlib.sha256()
    size = 0
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        while block := fin.read(CHUNK):
            sha.update(block)
            fout.write(block)
            size += len(block)
    if sha256 is not None and sha.hexdigest() != sha256:
        tmp.unlink(missing_ok=True)
        raise StageError(f"staged copy of {src} has sha256 {sha.hexdigest()[:12]}..., the manifest says "
                         f"{sha256[:12]}...; hint: hpctrain data verify {src.parent}")
    os.replace(tmp, dst)
    return size


def copy_split(source: Path, target: Path, split: str) -> dict[str, int]:
    """Copy one split's shards and indexes, then its manifest; returns {file: bytes}."""
    manifest = json.loads(manifest_path(source, split).read_text())
    files: dict[str, int] = {}
    for shard in manifest["shards"]:
        files[shard["name"]] = copy_verified(source / shard["name"], target / shard["name"], shard["sha256"])
        index = shard["index"]
        files[index] = copy_verified(source / index, target / index, shard.get("index_sha256"))
    name = manifest_path(source, split).name
    files[name] = copy_verified(source / name, target / name, None)
    return files


def stage_local(source: Path, target: Path, splits: Sequence[str]) -> dict[str, Any]:
    """The copy itself (local rank 0 only); returns what the marker records."""
    wanted = _wanted(source, splits)
    need = sum(shard["bytes"] for s in wanted for shard in json.loads(manifest_path(source, s).read_text())["shards"])
    target.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target).free
    if need > free:
        raise StageError(f"staging {need / 2**30:.2f} GiB into {target}, but only {free / 2**30:.2f} GiB are free; "
                         "hint: data.stage_dir=off or a larger local disk")
    _marker(target).unlink(missing_ok=True)  # an interrupted copy must not look current
    start, files = time.perf_counter(), {}
    for split in wanted:
        files.update(copy_split(source, target, split))
    seconds = time.perf_counter() - start
    total = sum(files.values())
    log.info("staged %d files, %.1f MB, from %s to %s in %.2f s (%.0f MB/s)", len(files), total / 1e6, source,
             target, seconds, total / 1e6 / max(seconds, 1e-9))
    record = {"source": str(source.resolve()), "manifests": wanted, "files": files, "bytes": total,
              "seconds": seconds, "mb_per_s": total / 1e6 / max(seconds, 1e-9)}
    atomic_write_bytes(_marker(target), json.dumps(record, indent=1).encode())
    return record


def stage_shards(source: str | Path, stage_dir: Path | None, env: ClusterEnv, splits: Sequence[str],
                 timeout_s: float = 3600.0) -> Path:
    """Return the directory to read shards from: ``source`` itself, or a verified node-local copy."""
    source = Path(source)
    if stage_dir is None:
        return source
    target = stage_target(source, stage_dir)
    error: BaseException | None = None
    if env.local_rank == 0:
        try:
            if is_current(source, target, splits):
                log.info("reusing the staged shards in %s", target)
            else:
                stage_local(source, target, splits)
        except BaseException as err:  # the waiting ranks must not hang: let them time out on the marker
            error = err
    _wait(source, target, splits, env, timeout_s, failed=error is not None)
    if error is not None:
        raise error
    return target


def _wait(source: Path, target: Path, splits: Sequence[str], env: ClusterEnv, timeout_s: float, failed: bool) -> None:
    """Every rank leaves only once its node's copy is complete (a barrier when there is a group)."""
    if dist.is_available() and dist.is_initialized() and env.world_size > 1:
        dist.barrier()
    if failed:
        return
    deadline = time.monotonic() + timeout_s
    while not is_current(source, target, splits):
        if time.monotonic() > deadline:
            raise StageError(f"waited {timeout_s:.0f} s for local rank 0 to stage {source} into {target}; "
                             "hint: look at local rank 0's log, or set data.stage_dir=off")
        time.sleep(0.5)
