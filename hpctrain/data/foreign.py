"""``data.path`` pointing at tars written elsewhere (``webdataset.ShardWriter``, ``tar``): indexed on first use.

``data.path`` may be

* a directory with hpctrain manifests (``hpctrain data shard`` / ``hpctrain data index``):
  used as it is;
* a directory of tars without a manifest: split ``S`` is the tars named ``S-*.tar``,
  ``S_*.tar`` or ``S.tar`` (e.g. ``train-000000.tar``, ``val-000000.tar``);
* a brace pattern of the training tars, ``DIR/train-{000000..000031}.tar`` (``{a..b}``
  ranges, zero-padded like their bounds, and ``{x,y}`` lists); the other splits are
  looked for in ``DIR`` as above; or a single ``.tar`` file.

The index (``<shard>.idx.json`` + ``<split>.manifest.json``) is built once per node by
local rank 0 while the node's other ranks wait (:mod:`hpctrain.data.nodeonce`). It is
written next to the tars (a pattern's index into ``DIR/.hpctrain-index-<hash>/``, since
a pattern selects some of the tars), or, when ``DIR`` is read-only, into
``$HPCTRAIN_CACHE/index/`` (default ``~/.cache/hpctrain/index/``); such a manifest records
``data_dir``, where the tars are. An index built this way is rebuilt when a tar's size or
mtime changed; a manifest written by ``hpctrain data shard`` is used as it is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.core.atomic import atomic_write_bytes
from hpctrain.core.cache import cache_root
from hpctrain.core.env import ClusterEnv
from hpctrain.core.section import ConfigError
from hpctrain.data.errors import ShardError
from hpctrain.data.indexing import index_existing, tar_stats
from hpctrain.data.manifest import load_manifest, manifest_path, parse_json, read_regular
from hpctrain.data.nodeonce import once_per_node

if TYPE_CHECKING:
    from hpctrain.config.data import DataConfig

log = logging.getLogger("hpctrain")
_BRACE = re.compile(r"\{([^{}]*)\}")
LABEL_HINT = ("store the class as <key>.cls (a text integer, WebDataset's convention) or as an integer "
              "'label' in <key>.json")


def expand_braces(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` -> a-000.tar, a-001.tar, a-002.tar; ``{x,y}`` -> x, y (nested left to right)."""
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[: match.start()], match.group(1), pattern[match.end():]
    numbers = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numbers:
        lo, hi = numbers.groups()
        if int(hi) < int(lo):
            raise ShardError(f"data.path pattern {pattern!r}: range {{{body}}} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    elif "," in body:
        items = body.split(",")
    else:
        raise ShardError(f"data.path pattern {pattern!r}: {{{body}}} is neither a range {{000..009}} "
                         "nor a list {a,b}")
    return [out for item in items for out in expand_braces(head + item + tail)]


def split_tars(directory: Path, split: str) -> list[Path]:
    """The tars of ``split`` by name: ``split-*.tar``, ``split_*.tar`` or ``split.tar``."""
    found = {p for pat in (f"{split}-*.tar", f"{split}_*.tar", f"{split}.tar") for p in directory.glob(pat)}
    return sorted(p for p in found if p.is_file())


def writable(directory: Path) -> bool:
    """Can this process add files to ``directory``? A directory without any write bit counts as
    read-only even for root (who could write it anyway): its owner said so."""
    if not directory.stat().st_mode & 0o222:
        return False
    probe = directory / f".hpctrain-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError:
        return False
    return True


@dataclass
class ForeignIndex:
    """The index of tars written elsewhere: where their manifests are read from (``root``) and which
    splits must be indexed (or mirrored) there first."""

    directory: Path
    root: Path
    todo: dict[str, list[Path]] = field(default_factory=dict)     # split -> tars to index into root
    mirror: dict[str, Path] = field(default_factory=dict)         # split -> hpctrain manifest to refer to


def _tag(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def foreign_index(path: str, splits: Sequence[str]) -> ForeignIndex:
    """What ``data.path`` means for ``splits`` (the first is the training split); reads only names."""
    given = Path(path)
    pattern = given.name if ("{" in given.name or given.suffix == ".tar") else None
    directory = given.parent if pattern else given
    if "{" in str(directory):
        raise ShardError(f"data.path={path}: braces are allowed in the file name only; hint: DIR/train-{{0..9}}.tar")
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.is_file() else "does not exist"
        raise ShardError(f"data.path={path}: {directory} {what}; hint: a directory of shards, or DIR/NAME-{{0..9}}.tar")
    found = {s: split_tars(directory, s) for s in splits}
    if pattern:
        names = expand_braces(pattern)
        found[splits[0]] = [directory / n for n in names]
        missing = [str(p) for p in found[splits[0]] if not p.is_file()]
        if missing:
            raise ShardError(f"data.path={path}: {len(missing)} of {len(names)} files do not exist, "
                             f"e.g. {missing[0]}; hint: check the range against `ls {directory}`")
    have_manifest = {s for s in splits if _usable(directory, s, found[s]) and not (pattern and s == splits[0])}
    todo = {s: tars for s, tars in found.items() if tars and s not in have_manifest}
    if not todo:
        if splits[0] not in have_manifest:
            _no_training_split(directory, splits[0])
        return ForeignIndex(directory, directory)
    tag = _tag(str(directory.resolve()), pattern or "")
    if writable(directory):
        root = directory / f".hpctrain-index-{tag}" if pattern else directory
    else:
        root = cache_root() / "index" / f"{directory.resolve().name}-{tag}"
    mirror = {s: manifest_path(directory, s) for s in have_manifest} if root != directory else {}
    return ForeignIndex(directory, root, todo, mirror)


def _usable(directory: Path, split: str, tars: list[Path]) -> bool:
    """A manifest next to the tars, unless it was indexed from tars that have changed since."""
    path = manifest_path(directory, split)
    if not path.is_file():
        return False
    if not tars:
        return True
    manifest = _read_json(path)
    if not isinstance(manifest, dict):
        return True  # load_manifest names the broken file
    indexed_from = manifest.get("indexed_from")
    return indexed_from is None or indexed_from == tar_stats(tars)


def _read_json(path: Path) -> object:
    """A manifest's JSON, or None when it cannot be read or parsed (a FIFO, a device, a giant,
    bad UTF-8): bounded and non-blocking, for the checks that only decide whether to index."""
    try:
        return parse_json(read_regular(path, "manifest"), "manifest", path)
    except ShardError:
        return None


def _no_training_split(directory: Path, split: str) -> None:
    tars = sorted(p.name for p in directory.glob("*.tar"))
    if tars:  # tars are there, but which of them is the training split is not said by any name
        shown = ", ".join(tars[:3]) + (", ..." if len(tars) > 3 else "")
        raise ShardError(f"cannot tell which tars in {directory} hold the {split} split: {len(tars)} tar files "
                         f"({shown}), none named {split}-*.tar and no {split}.manifest.json; hint: rename them "
                         f"{split}-NNNNNN.tar (and val-NNNNNN.tar), set data.path to a pattern such as "
                         f"{directory}/NAME-{{000000..000009}}.tar, or run "
                         f"`hpctrain data index {directory} --split {split} --pattern 'GLOB'`")


def _fresh(root: Path, split: str, tars: list[Path]) -> bool:
    path = manifest_path(root, split)
    if not path.is_file():
        return False
    manifest = _read_json(path)
    return isinstance(manifest, dict) and manifest.get("indexed_from") == tar_stats(tars)


def _mirror_bytes(source: Path) -> bytes:
    """A copy of an hpctrain manifest that points at the original's tars and indexes. The original
    is checked as the loader checks it (plain shard and index names), so the copy cannot point
    outside the original's directory."""
    manifest = load_manifest(source.parent, source.name[: -len(".manifest.json")])
    directory = source.parent.resolve()
    manifest["data_dir"] = str(directory)
    manifest["shards"] = [{**s, "index": str(directory / s["index"])} for s in manifest["shards"]]
    return json.dumps(manifest, indent=1).encode()


def _mirrored(root: Path, split: str, source: Path) -> bool:
    """Whether the mirror is current; False (not an error: the waiting ranks poll this) when either
    manifest is unreadable, so local rank 0's _index reports it."""
    path = manifest_path(root, split)
    try:
        return path.is_file() and read_regular(path, "manifest") == _mirror_bytes(source)
    except ShardError:
        return False


def _ready(p: ForeignIndex) -> bool:
    return (all(_fresh(p.root, s, tars) for s, tars in p.todo.items())
            and all(_mirrored(p.root, s, src) for s, src in p.mirror.items()))


def _index(p: ForeignIndex, train_split: str) -> None:
    p.root.mkdir(parents=True, exist_ok=True)
    done = []
    for split, tars in p.todo.items():
        if _fresh(p.root, split, tars):
            continue
        manifest = index_existing(p.directory, split, tars=tars, out=p.root, require_label=split == train_split,
                                  label_hint=LABEL_HINT)
        done.append(f"{split}: {len(tars)} tars, {manifest['total_samples']} samples")
    for split, source in p.mirror.items():
        if not _mirrored(p.root, split, source):
            atomic_write_bytes(manifest_path(p.root, split), _mirror_bytes(source))
    if done:
        log.info("indexed the tars in %s on first use (%s) into %s; later runs reuse the index",
                 p.directory, "; ".join(done), p.root)


def prepare(path: str, splits: Sequence[str], env: ClusterEnv) -> Path:
    """The directory whose manifests describe ``data.path``; indexes tars written elsewhere first
    (local rank 0 once per node, the other ranks wait; every rank fails if it fails)."""
    def work() -> None:
        p = foreign_index(path, splits)
        if p.todo or p.mirror:
            _index(p, splits[0])

    # Every rank enters (the decision whether to index is local rank 0's alone: a waiter
    # that looked after rank 0 finished would see nothing to do and skip the collective).
    once_per_node("indexing the shards", env, work, lambda: _ready(foreign_index(path, splits)))
    return foreign_index(path, splits).root


def shards_root(data: DataConfig, env: ClusterEnv, seq_len: int | None) -> Path:
    """Source hook (``data.name=shards``): the manifests of ``data.path``, its tars indexed on first use."""
    if not data.path:
        raise ConfigError("data.name=shards needs data.path=DIR (made by `hpctrain data shard SOURCE DIR`, "
                          "or a directory of WebDataset tars)")
    return prepare(data.path, ["train", data.val_split], env)
