"""Tar shards on object storage (``data.path=s3://bucket/prefix``): the data side of
:mod:`hpctrain.core.storage`'s client.

* The metadata (each split's manifest and per-shard indexes, a few MB) is mirrored once per node
  by local rank 0 into ``$HPCTRAIN_CACHE/remote/<hash>/`` (indexes checked against the manifest's
  sha256); the mirrored manifest records ``remote`` (the URL and the storage options, never a
  secret), so everything that reads a manifest (the sampler's split, resume, text layout) works
  unchanged, and only the tar bytes are fetched from the store.
* :class:`ShardReader` reads the tars: whole-shard readahead in parallel blocks (the remote
  counterpart of ``posix_fadvise(WILLNEED)``) for shard/window/file order, a batch's exact ranges
  in parallel for a global shuffle; bounded memory per process.
* With a stage directory (``data.stage_dir``, ``$SLURM_TMPDIR``) the tars are downloaded once per
  node instead (sha256-checked, :mod:`hpctrain.data.stage`), and later epochs and restarts read
  locally.
* Writing (``hpctrain data shard ... s3://``): each shard is uploaded as soon as it is complete,
  tars and indexes first and the manifest last, so a reader never sees a manifest whose shards
  are not all there; verifying downloads one shard at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hpctrain.config.data import DataConfig
from hpctrain.core.atomic import atomic_write_bytes
from hpctrain.core.cache import cache_root
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import RunError
from hpctrain.core.storage import Store, is_url, key_problem, open_store
from hpctrain.data.errors import ShardError
from hpctrain.data.foreign import shards_root as local_shards_root
from hpctrain.data.manifest import (
    JSON_LIMIT,
    check_manifest,
    file_sha256,
    load_manifest,
    parse_json,
    plain_name,
    read_regular,
)
from hpctrain.data.nodeonce import once_per_node
from hpctrain.data.verify import Problem, label_spec, no_shards, verify_shard

log = logging.getLogger("hpctrain")
BLOCK = 8 << 20  # readahead unit: large enough to amortise a request, small enough to start early
THREADS = 8  # ranged reads in flight per process
BUDGET = 512 << 20  # bytes of shard data one process holds or has in flight
MANIFEST_SUFFIX = ".manifest.json"


class ShardGoneError(RunError):
    """A tar the store listed when the run started is not there any more (deleted or renamed since):
    the run stops (exit 1) naming it; nothing of the sample's is at fault, so it is never skipped."""


def gone(store: Store, name: str) -> ShardGoneError:
    return ShardGoneError(f"shard {store.where(name)} is gone from the store: it was listed when the run started "
                          f"(deleted or renamed since?); hint: upload it again (hpctrain data shard SOURCE "
                          f"{store.url}), check with `hpctrain data verify {store.url}`, then resume")


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def mirror_root(url: str) -> Path:
    return cache_root() / "remote" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def remote_of(manifest: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(url, storage options) of a mirrored manifest; None for shards on a file system."""
    rec = manifest.get("remote")
    if rec is None:
        return None
    return str(rec["url"]), dict(rec.get("options") or {})


def remote_splits(listed: Iterable[str]) -> list[str]:
    """The splits with a manifest at the top of a store, from its listing's keys."""
    return sorted(k[: -len(MANIFEST_SUFFIX)] for k in listed if k.endswith(MANIFEST_SUFFIX) and "/" not in k)


def read_listed(store: Store, key: str, listed: Mapping[str, int], what: str) -> bytes:
    """``key`` (a manifest or an index) read whole, at most the size the listing gave: refused before a
    byte is downloaded when that is beyond :data:`JSON_LIMIT` (an object grown since the listing is
    read short, and then fails its check)."""
    size = listed.get(key)
    if size is None:
        raise ShardError(f"{what} {store.where(key)} is missing from the store; hint: write the split again "
                         f"(hpctrain data shard SOURCE {store.url}), then `hpctrain data verify {store.url}`")
    if size > JSON_LIMIT.bytes():
        raise ShardError(JSON_LIMIT.refusal(f"{what} {store.where(key)}", size))
    try:
        return store.read_range(key, 0, size)
    except FileNotFoundError:
        raise ShardError(f"{what} {store.where(key)} was deleted from the store while it was read; hint: run again "
                         f"once the split is written whole (`hpctrain data verify {store.url}`)") from None


def _fetch_split(store: Store, url: str, options: Mapping[str, Any], split: str, out: Path,
                 listed: Mapping[str, int]) -> None:
    """One split's manifest and indexes into ``out``, with the tars' sizes from the store's listing
    (``listed``), so that no rank lists the store again; an unchanged file is not rewritten."""
    key = split + MANIFEST_SUFFIX
    manifest = parse_json(read_listed(store, key, listed, "manifest"), "manifest", Path(store.where(key)))
    if not isinstance(manifest, dict) or "data_dir" in manifest or "remote" in manifest:
        raise ShardError(f"{store.where(key)} is not a manifest of shards beside it; hint: write the split with "
                         f"`hpctrain data shard SOURCE {url}`")
    check_manifest(Path(store.where(key)), out, manifest)
    for shard in manifest["shards"]:
        # on a store the tars and indexes lie beside the manifest, under keys a client can read
        for name in (shard["name"], shard["index"]):
            if not plain_name(name) or key_problem(name):
                raise ShardError(f"manifest {store.where(key)}: shard {shard['name']!r}: {name!r} is not a key "
                                 f"beside the manifest (a plain name without whitespace, '?' or '#'); hint: hpctrain "
                                 f"data shard SOURCE {url}")
        local = out / shard["index"]
        want = shard.get("index_sha256")
        if local.is_file() and isinstance(want, str) and sha256_of(read_regular(local, "index")) == want:
            continue
        data = read_listed(store, shard["index"], listed, "index")
        if isinstance(want, str) and sha256_of(data) != want:
            raise ShardError(f"index {store.where(shard['index'])} has another sha256 than the manifest lists; hint: "
                             f"hpctrain data verify {url}")
        atomic_write_bytes(local, data)
    sizes = {s["name"]: listed[s["name"]] for s in manifest["shards"] if s["name"] in listed}
    manifest["remote"] = {"url": url, "options": dict(options), "sizes": sizes}
    mirrored = json.dumps(manifest, indent=1).encode()
    path = out / key
    if not path.is_file() or path.read_bytes() != mirrored:
        atomic_write_bytes(path, mirrored)  # last: the mirror of a split is current once its manifest is


def mirror(url: str, options: Mapping[str, Any], splits: Sequence[str] | None = None) -> Path:
    """The local directory whose manifests describe the shards at ``url`` (refreshed from it)."""
    url = url.rstrip("/")
    store = open_store(url, options)
    listed = store.list()  # once per node and run (shards_root): the splits, and every tar's size for the ranks
    found = remote_splits(listed)
    wanted = [s for s in (splits or found) if s in found]
    if not found or (splits and splits[0] not in found):
        first = (splits or ["train"])[0]
        raise ShardError(f"no manifest {url}/{first}{MANIFEST_SUFFIX} (found: {found or 'none'}); hint: hpctrain "
                         f"data shard SOURCE {url} --split {first}")
    out = mirror_root(url)
    out.mkdir(parents=True, exist_ok=True)
    for split in wanted:
        _fetch_split(store, url, options, split, out, listed)
    return out


def shards_root(data: DataConfig, env: ClusterEnv, seq_len: int | None) -> Path:
    """Source hook (``data.name=shards``): a URL's metadata mirror, or a directory as before."""
    if not is_url(data.path):
        return local_shards_root(data, env, seq_len)
    url, splits = str(data.path).rstrip("/"), ["train", data.val_split]
    root = mirror_root(url)

    def ready() -> bool:
        return (root / f"train{MANIFEST_SUFFIX}").is_file()

    once_per_node("mirroring the shard indexes", env, lambda: log.info("shard indexes of %s in %s", url,
                                                                       mirror(url, data.storage_options, splits)),
                  ready)
    return root


# ---------------------------------------------------------------- reading


class ShardReader:
    """Byte ranges of one split's tars on a store, per process (a forked worker makes its own)."""

    def __init__(self, store: Store, names: Sequence[str], sizes: Sequence[int], *, readahead: bool,
                 block: int = BLOCK, threads: int = THREADS, budget: int = BUDGET) -> None:
        self.store, self.names, self.sizes, self.readahead = store, list(names), list(sizes), readahead
        self.block, self.window = block, max(1, budget // block)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="hpctrain-s3")
        self.blocks: OrderedDict[tuple[int, int], Future[bytes]] = OrderedDict()
        self.ranges: dict[tuple[int, int, int], Future[bytes]] = {}
        self.scheduled: dict[int, tuple[int, int]] = {}  # shard -> the blocks [first, last) readahead asked for
        self.lock = threading.Lock()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _range(self, shard: int, start: int, end: int) -> bytes:
        try:
            return self.store.read_range(self.names[shard], start, end)
        except FileNotFoundError:
            raise gone(self.store, self.names[shard]) from None

    def _ranges(self, shard: int, starts: list[int], ends: list[int]) -> list[bytes]:
        try:
            return self.store.read_ranges(self.names[shard], starts, ends)
        except FileNotFoundError:
            raise gone(self.store, self.names[shard]) from None

    def _block(self, shard: int, b: int) -> Future[bytes]:
        with self.lock:
            fut = self.blocks.get((shard, b))
            if fut is None:
                start = b * self.block
                end = min(self.sizes[shard], start + self.block)
                fut = self.pool.submit(self._range, shard, start, end)
                self.blocks[(shard, b)] = fut
                while len(self.blocks) > self.window:  # the least recently used block goes
                    self.blocks.popitem(last=False)
            else:
                self.blocks.move_to_end((shard, b))
            return fut

    def _ahead(self, shard: int, b: int) -> None:
        """Blocks b.. of the shard requested now: the epoch reads all of it soon, in shuffled order.
        Cheap when they already are (every sample's read asks)."""
        until = self.scheduled.get(shard, (-1, -1))
        if until[0] <= b < until[1] - self.window // 4:
            return
        last = min(-(-self.sizes[shard] // self.block), b + self.window // 2)
        for nb in range(b, last):
            self._block(shard, nb)
        self.scheduled[shard] = (b, last)

    def prefetch(self, wanted: Iterable[tuple[int, int, int]]) -> None:
        """Start fetching (shard, start, length) ranges in parallel, before they are read one by one."""
        wanted = list(wanted)
        if self.readahead:
            for shard in dict.fromkeys(s for s, _, _ in wanted):
                first = min(st for s, st, _ in wanted if s == shard)
                self._ahead(shard, first // self.block)
            return
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for shard, start, length in wanted:
            if (shard, start, length) not in self.ranges:
                by_shard.setdefault(shard, []).append((start, length))
        for shard, spans in by_shard.items():
            # one call per shard: the client coalesces near ranges and fetches them concurrently
            fut = self.pool.submit(self._ranges, shard, [s for s, _ in spans], [s + n for s, n in spans])
            for i, (start, length) in enumerate(spans):
                self.ranges[(shard, start, length)] = _pick(fut, i)

    def read(self, shard: int, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        fut = self.ranges.pop((shard, start, length), None)
        if fut is not None:
            return fut.result()
        if not self.readahead:
            return self._range(shard, start, start + length)
        first, last = start // self.block, (start + length - 1) // self.block
        self._ahead(shard, first)
        off = start - first * self.block
        if first == last:
            return self._block(shard, first).result()[off : off + length]
        parts = [self._block(shard, b).result() for b in range(first, last + 1)]  # a sample across blocks
        parts[0] = parts[0][off:]
        return b"".join(parts)[:length]


def _pick(fut: Future[list[bytes]], i: int) -> Future[bytes]:
    out: Future[bytes] = Future()

    def done(f: Future[list[bytes]]) -> None:
        err = f.exception()
        if err is not None:
            out.set_exception(err)
        else:
            out.set_result(f.result()[i])
    fut.add_done_callback(done)
    return out


def open_reader(manifest: Mapping[str, Any], readahead: bool, sizes: Sequence[int]) -> ShardReader:
    rec = remote_of(manifest)
    assert rec is not None  # only called for a mirrored manifest
    return ShardReader(open_store(*rec), [s["name"] for s in manifest["shards"]], sizes, readahead=readahead)


def remote_sizes(manifest: Mapping[str, Any]) -> dict[str, int]:
    """{tar name: size} of the split's tars on the store: as the mirror recorded them from its listing
    (made once per node for the run; a store of 100,000 tars is 100 listing requests, which every rank
    of a large job would otherwise repeat at start), or from a listing now for an older mirror."""
    recorded = manifest["remote"].get("sizes")
    if isinstance(recorded, dict):
        return {str(k): int(v) for k, v in recorded.items()}
    rec = remote_of(manifest)
    assert rec is not None
    listed = open_store(*rec).list()
    names = {s["name"] for s in manifest["shards"]}
    return {k: v for k, v in listed.items() if k in names}


# ---------------------------------------------------------------- staging, writing, verifying


def download_verified(store: Store, shard: Mapping[str, Any], dst: Path) -> dict[str, Any]:
    """One tar of a mirrored manifest downloaded from ``store`` to ``dst`` (durably), accepted only
    with the manifest's sha256; a mismatch leaves nothing at ``dst``."""
    try:
        store.get_file(shard["name"], dst)
    except FileNotFoundError:
        raise gone(store, shard["name"]) from None
    sha = file_sha256(dst)
    if sha != shard["sha256"]:
        dst.unlink(missing_ok=True)
        raise ShardError(f"downloaded {store.where(shard['name'])} has sha256 {sha[:12]}..., the manifest says "
                         f"{str(shard['sha256'])[:12]}...; hint: hpctrain data verify {store.url}")
    st = dst.stat()
    return {"bytes": st.st_size, "sha256": sha, "mtime_ns": st.st_mtime_ns}


def uploading(url: str, options: Mapping[str, Any]) -> tuple[Path, Callable[[Path, str], None], Callable[[], None]]:
    """(a local scratch directory, a function uploading and removing one finished file of it, a
    cleanup) for writing shards to ``url``: the disk holds one shard at a time."""
    store = open_store(url, options)
    scratch = Path(tempfile.mkdtemp(prefix="hpctrain-upload-"))
    started: set[str] = set()

    def upload(path: Path, name: str) -> None:
        split = name[: -len(MANIFEST_SUFFIX)] if name.endswith(MANIFEST_SUFFIX) else name.rsplit("-", 1)[0]
        if split not in started:  # rewriting a split: its old manifest goes before any of its tars is replaced
            store.delete(split + MANIFEST_SUFFIX)
            started.add(split)
        store.put_file(name, path)
        path.unlink(missing_ok=True)

    def cleanup() -> None:
        for p in scratch.iterdir():
            p.unlink(missing_ok=True)
        scratch.rmdir()
    return scratch, upload, cleanup


def other_classes(url: str, options: Mapping[str, Any], writing: Sequence[str]) -> tuple[str, ...] | None:
    """The class names of a split already at ``url`` that is not being rewritten (train's first)."""
    store = open_store(url, options)
    listed = store.list()
    others = sorted((s for s in remote_splits(listed) if s not in writing), key=lambda s: s != "train")
    for split in others:
        try:
            classes = json.loads(read_listed(store, split + MANIFEST_SUFFIX, listed, "manifest")).get("classes")
        except (ValueError, AttributeError, RecursionError):  # ShardError too: not a manifest to follow
            continue
        if classes:
            return tuple(str(c) for c in classes)
    return None


def verify_remote(url: str, options: Mapping[str, Any], split: str | None, deep: bool,
                  report: Callable[[str, list[Any]], None]) -> int:
    """``hpctrain data verify URL``: each split's shards downloaded one at a time and checked as a
    local directory is; ``report(split, problems)`` per split; returns the number of problems."""
    store = open_store(url, options)
    splits = [split] if split else remote_splits(store.list())
    if not splits:
        raise ShardError(f"{url} holds no *{MANIFEST_SUFFIX}; hint: hpctrain data shard SOURCE {url}")
    root = mirror(url, options, splits)
    bad = 0
    with tempfile.TemporaryDirectory(prefix="hpctrain-verify-") as tmp:
        for name in splits:
            manifest = load_manifest(root, name)
            sizes = remote_sizes(manifest)
            problems: list[Any] = [] if manifest["shards"] else [no_shards(name, store.url)]
            for shard in manifest["shards"]:
                if shard["name"] not in sizes:
                    problems.append(Problem(shard["name"], None, "file is missing"))
                    continue
                if not deep:  # --quick: sizes from the listing, nothing downloaded
                    if sizes[shard["name"]] != shard["bytes"]:
                        problems.append(Problem(shard["name"], None, f"{sizes[shard['name']]} bytes, manifest says "
                                                                     f"{shard['bytes']} (truncated?)"))
                    continue
                local = Path(tmp) / shard["name"]
                try:
                    store.get_file(shard["name"], local)
                except FileNotFoundError:  # deleted since the listing
                    problems.append(Problem(shard["name"], None, "file is missing (deleted since the listing)"))
                    continue
                problems += verify_shard(root, shard, deep=deep, tars=Path(tmp), labels=label_spec(manifest),
                                         fields=manifest["fields"])
                local.unlink()
            report(name, problems)
            bad += len(problems)
    return bad
