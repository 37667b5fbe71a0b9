"""Checkpoints on object storage, as a tier: ``checkpoint.remote=s3://BUCKET/PREFIX``.

Layout: ``PREFIX/step-000001234/`` holds the files of the local checkpoint under the same names,
``manifest.json`` among them. The manifest is the commit marker: it is uploaded last, after
every file it names, and deleted first (before any file) when a checkpoint is removed or
uploaded again, so a checkpoint whose upload was cut short (a killed job, a server that went
away) has files but no manifest and is never listed, downloaded or loaded.

Only rank 0 uploads, every file of the committed checkpoint, the shards of a sharded (dcp)
checkpoint included: they all lie in the run directory, which every rank shares (the commit
protocol needs it), and one uploader needs no cross-rank agreement before the marker (which a
background thread could not have without a collective on the training group).

The upload runs in a thread of its own: the training loop hands it each committed checkpoint
and goes on. At most one checkpoint uploads while ``checkpoint.remote_queue`` more wait; a
newer one arriving at a full queue takes the place of the oldest waiting one (said in the log),
so the loop never waits and the tier always gets the newest. Checkpoints that wait or upload are
kept by the local retention until they are uploaded. Resume (rank 0, then broadcast): when the
object store holds a newer committed checkpoint than the run directory (a new allocation on
another cluster starts with an empty one), it is downloaded into ``RUN_DIR/checkpoints/`` as a
``.partial-`` directory, verified against its manifest, then renamed: from there it is one of
the run's own checkpoints.

A prefix has one owner (:mod:`hpctrain.checkpoint.tier_owner`): a second run is refused at
resume, and retention, uploads over an existing name and resume touch only the checkpoints
whose manifest carries the owner's ``run_id`` (or none: written before runs had ids).
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.checkpoint import confine, layout, tier_owner
from hpctrain.checkpoint.tier_owner import Claim
from hpctrain.core.atomic import replace_durably
from hpctrain.core.errors import UserError

if TYPE_CHECKING:
    from hpctrain.core.storage import Store

log = logging.getLogger("hpctrain")

SCHEME = "s3://"
FILE_THREADS = 4  # files of one checkpoint uploaded (and downloaded) at once: the shards of a dcp checkpoint
SUPERSEDED = "superseded-manifest.json"  # a remote checkpoint past a resume=PATH: no longer committed, kept
PROGRESS_EVERY_S = 30.0  # an upload longer than this logs its progress this often


class RemoteUrlError(UserError):
    """A checkpoint.remote value (or an ``hpctrain ckpt`` URL) that names no s3 prefix."""


def check_url(key: str, url: str) -> str:
    """``url`` without trailing slashes, or :class:`RemoteUrlError` naming ``key``."""
    if not url.startswith(SCHEME) or not url[len(SCHEME):].split("/")[0]:
        raise RemoteUrlError(f"{key}={url!r} is not an s3://BUCKET/PREFIX URL; hint: "
                             "checkpoint.remote=s3://my-bucket/runs/my-run (endpoint: AWS_ENDPOINT_URL or "
                             "checkpoint.storage_options.endpoint_url)")
    return url.rstrip("/")


def is_remote(path: str | Path | None) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def open_store(url: str, options: Mapping[str, Any] | None = None) -> Store:
    from hpctrain.core.storage import open_store as _open  # optional: the object-store client is an extra

    return _open(url, dict(options or {}))


def resolve_url(url: str, options: Mapping[str, Any] | None = None,
                key: str = "the URL") -> tuple[Store, list[tuple[int, str]]]:
    """(store of the tier, its committed checkpoints as (step, name), oldest first) of a tier's
    URL ``s3://B/PREFIX``, or of one checkpoint's ``s3://B/PREFIX/step-N`` (then that one only:
    a :class:`~layout.NoCheckpointError` where it is not committed)."""
    url = check_url(key, url)
    head, _, last = url.rpartition("/")
    one = layout.step_of(Path(last)) is not None and head != "s3:/"
    store = open_store(head if one else url, options)
    entries = committed(store)
    if one:
        entries = [(step, name) for step, name in entries if name == last]
        if not entries:
            raise layout.NoCheckpointError(f"{url} is not a committed checkpoint (no {layout.MANIFEST} uploaded); "
                                           f"hint: `hpctrain ckpt list {head}`")
    return store, entries


def fetch_newest(store: Store, entries: list[tuple[int, str]], root: Path, run_id: str | None = None,
                 failed: set[str] | None = None) -> Path | None:
    """The newest of ``entries`` that downloads intact into ``root`` (corrupt ones, and with
    ``run_id`` another run's, are skipped, said in the log, and added to ``failed``); None when none does."""
    for _, name in reversed(entries):
        start = time.monotonic()
        try:
            path = download(store, name, root, run_id)
        except layout.UnreadableCheckpointError:
            raise
        except layout.CheckpointError as err:
            log.warning("checkpoint.remote: %s/%s is skipped: %s", store.url, name, _one_line(err))
            if failed is not None:
                failed.add(name)
            continue
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        log.info("checkpoint.remote: downloaded %s/%s into %s (%.1f MB in %.1f s, verified against its manifest)",
                 store.url, name, path, size / 1e6, time.monotonic() - start)
        return path
    return None


# ---------------------------------------------------------------- listing


def committed(store: Store) -> list[tuple[int, str]]:
    """Committed checkpoints in ``store`` (a manifest uploaded), oldest first."""
    return sorted((step, name) for name, step, files in _checkpoints(store) if layout.MANIFEST in files)


def _checkpoints(store: Store) -> list[tuple[str, int, dict[str, int]]]:
    """(name, step, {file: size}) of every ``step-N/`` under the store's prefix, committed or not."""
    found: dict[str, dict[str, int]] = {}
    for key, size in store.list("").items():
        name, _, rest = key.partition("/")
        if rest and layout.step_of(Path(name)) is not None:
            found.setdefault(name, {})[rest] = size
    return [(name, layout.step_of(Path(name)) or 0, files) for name, files in sorted(found.items())]


def read_manifest(store: Store, name: str) -> dict[str, Any]:
    """The manifest of remote checkpoint ``name``, checked as a local one is (untrusted input)."""
    key = f"{name}/{layout.MANIFEST}"
    where = f"{store.url}/{key}"
    if store.size(key) > layout.MAX_MANIFEST:  # asked before a byte is downloaded
        raise layout.CheckpointError(f"{where} holds more than the {layout.MAX_MANIFEST:,} bytes a manifest ever "
                                     "holds (crafted or corrupted)")
    data = store.read(key)
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as err:
        raise layout.CheckpointError(f"{where} is not valid JSON ({err}) (corrupted)") from None
    layout.check_manifest(manifest, Path(name) / layout.MANIFEST)  # names confined to the checkpoint
    return manifest


# ---------------------------------------------------------------- one checkpoint up, down, away


def upload(store: Store, path: Path, progress: Callable[[int, int], None] | None = None) -> int:
    """Upload committed checkpoint ``path``: a previous copy of the same name loses its marker
    first, then every file goes up, then the manifest. Returns the bytes uploaded."""
    manifest = layout.read_manifest(path)
    files = sorted(manifest["files"], key=lambda n: -manifest["files"][n]["size"])  # the big ones start first
    total = sum(manifest["files"][n]["size"] for n in files)
    delete(store, path.name)
    done = 0
    with ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="hpctrain-upload") as pool:
        for size in pool.map(lambda n: _put(store, path, n), files):
            done += size
            if progress is not None:
                progress(done, total)
    store.put_file(f"{path.name}/{layout.MANIFEST}", path / layout.MANIFEST)  # the commit marker, last
    return total


def _put(store: Store, path: Path, name: str) -> int:
    local = path / name
    store.put_file(f"{path.name}/{name}", local)
    return local.stat().st_size


def delete(store: Store, name: str) -> None:
    """Remove remote checkpoint ``name``: its marker first, so a half-deleted one is never committed."""
    keys = list(store.list(f"{name}/"))  # relative to the store's prefix, as every key here
    marker = f"{name}/{layout.MANIFEST}"
    store.delete(marker)
    for key in keys:
        if key != marker:
            store.delete(key)


def download(store: Store, name: str, root: Path, run_id: str | None = None) -> Path:
    """Download remote checkpoint ``name`` into ``root`` (a checkpoints/ directory or any
    folder): files into ``.partial-NAME``, the manifest last, every file verified against it,
    then renamed to ``root/NAME``. A corrupt, crafted or incomplete copy (and with ``run_id``
    another run's) raises CheckpointError and leaves nothing behind."""
    step = layout.step_of(Path(name))
    if step is None:
        raise layout.CheckpointError(f"{store.url}/{name} is not a checkpoint name (step-N)")
    manifest = read_manifest(store, name)
    owner = manifest.get("run_id")
    if run_id is not None and owner not in (None, run_id):
        raise layout.CheckpointError(f"{store.url}/{name} is a checkpoint of run {owner}, not of this run ({run_id}) "
                                     "that owns the prefix: never resumed nor deleted by it")
    _check_sizes(store, name, manifest["files"])
    partial = layout.partial_dir(root, step)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        with ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="hpctrain-download") as pool:
            list(pool.map(lambda n: _get(store, name, n, partial), sorted(manifest["files"])))
        (partial / layout.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        problems = layout.verify(partial)
        if problems:
            raise layout.CheckpointError(f"{store.url}/{name} is corrupt: {'; '.join(problems)}")
        final = root / name
        if final.exists():  # a local directory of that name without a manifest (never committed)
            layout.move_aside(final, layout.UNCOMMITTED_PREFIX, "it has no manifest, and the remote copy replaces it")
        replace_durably(partial, final)
        return final
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _check_sizes(store: Store, name: str, files: dict[str, Any]) -> None:
    """Every file the manifest names is there with its size, asked before a byte is downloaded
    (a missing or truncated upload, or a crafted huge object, costs no download)."""
    sizes = {key[len(name) + 1:]: size for key, size in store.list(f"{name}/").items()}
    for file, entry in sorted(files.items()):
        if file not in sizes:
            raise layout.CheckpointError(f"{store.url}/{name}/{file} is missing (named by its manifest)")
        if sizes[file] != entry["size"]:
            raise layout.CheckpointError(f"{store.url}/{name}/{file}: size {sizes[file]} != {entry['size']} in the "
                                         "manifest (truncated or overwritten)")


# What a name from the manifest can make the local write fail with (a crafted checkpoint, skipped):
# a part too long, a file where a folder belongs or the reverse. Anything else (a full disk,
# permissions) is this machine's, and raised.
_NAME_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY})


def _get(store: Store, name: str, file: str, partial: Path) -> None:
    target = partial / file  # check_manifest confined every name to the checkpoint directory
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(f"{name}/{file}", target)
    except FileNotFoundError:
        raise layout.CheckpointError(f"{store.url}/{name}/{file} is missing (named by its manifest)") from None
    except OSError as err:
        if err.errno in _NAME_ERRNOS:
            raise confine.RefusedFileError(f"{store.url}/{name}: its manifest names {file!r}, which cannot be written "
                                           f"here ({err.strerror}): crafted or damaged, skipped") from None
        raise layout.unreadable(target, err, "written") from None


def retain(store: Store, keep_last: int, keep_every: int | None, protect: set[int],
           mine: Callable[[str], bool] | None = None) -> list[str]:
    """Retention on the remote tier, on its own: the rules of the local tier over the remote's
    committed checkpoints that are ``mine`` (default: all), others never counted nor touched.
    Uploads cut short (files without a marker) older than the newest committed one of ours go
    too (only the owner uploads there). Returns the names removed."""
    entries = _checkpoints(store)
    own = {name for name, _, files in entries if layout.MANIFEST in files and (mine is None or mine(name))}
    steps = sorted(step for name, step, _ in entries if name in own)
    doomed = set(layout.to_delete(steps, keep_last, keep_every, protect))
    newest = steps[-1] if steps else -1
    removed = []
    for name, step, files in entries:
        cut_short = layout.MANIFEST not in files and SUPERSEDED not in files and step < newest
        if (step in doomed and name in own) or cut_short:
            delete(store, name)
            removed.append(name)
    return removed


# ---------------------------------------------------------------- the background uploader


@dataclass
class _Job:
    path: Path
    committed_at: float  # time.monotonic() of the local commit: the lag is measured from it

    @property
    def step(self) -> int:
        return layout.step_of(self.path) or 0


@dataclass
class UploadStats:
    uploaded: list[int] = field(default_factory=list)  # steps, in order
    failed: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)   # replaced in a full queue by a newer checkpoint


class Uploader:
    """Uploads committed checkpoints in a daemon thread (rank 0). ``submit`` never blocks."""

    def __init__(self, store: Store, *, keep_last: int, keep_every: int | None, queue: int = 2,
                 protect: Callable[[], set[int]] = set, after: Callable[[], None] | None = None,
                 guard: Callable[[str], str | None] | None = None, mine: Callable[[str], bool] | None = None,
                 uploaded: Callable[[str], None] | None = None) -> None:
        """``queue``: checkpoints that may wait while one uploads; ``protect``: steps the remote
        retention keeps whatever their age (the best one); ``after``: called after each upload
        (the local retention, which kept the checkpoint while it waited); ``guard``: why
        checkpoint NAME may not go up now (None: it may); ``mine``: is remote checkpoint NAME
        this run's (retention's choice); ``uploaded``: told each NAME that went up."""
        self.store, self.keep_last, self.keep_every, self.bound = store, keep_last, keep_every, queue
        self.protect, self.after, self.guard, self.mine, self.uploaded = protect, after, guard, mine, uploaded
        self.stats = UploadStats()
        self._waiting: deque[_Job] = deque()
        self._current: _Job | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="hpctrain-ckpt-upload", daemon=True)
        self._thread.start()

    def submit(self, path: Path) -> None:
        with self._cond:
            if any(job.path == path for job in self._waiting):
                return
            if len(self._waiting) >= self.bound:
                dropped = self._victim()
                self._waiting.remove(dropped)
                self.stats.skipped.append(dropped.step)
                log.warning("checkpoint.remote: uploads lag behind the saves (checkpoint.remote_queue=%d full): %s is "
                            "not uploaded, the newer %s takes its place", self.bound, dropped.path.name, path.name)
            self._waiting.append(_Job(path, time.monotonic()))
            self._cond.notify_all()

    def _victim(self) -> _Job:
        """The waiting checkpoint a newer one replaces: the oldest that keep_every does not ask to keep."""
        for job in self._waiting:
            if not (self.keep_every and job.step % self.keep_every == 0):
                return job
        return self._waiting[0]

    def pending(self) -> set[int]:
        """Steps waiting or uploading: the local retention keeps them until they are up."""
        with self._cond:
            jobs = [*self._waiting, *([self._current] if self._current else [])]
            return {job.step for job in jobs}

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait()
                if not self._waiting:
                    return
                self._current = self._waiting.popleft()
            try:
                self._upload(self._current)
            finally:
                with self._cond:
                    self._current = None
                self._after()
                with self._cond:
                    self._cond.notify_all()

    def _after(self) -> None:
        try:
            if self.after is not None:
                self.after()
        except Exception as err:  # noqa: BLE001 - retention never ends a run; the next save retries it
            log.warning("checkpoint retention after an upload: %s", _one_line(err))

    def _upload(self, job: _Job) -> None:
        where = f"{self.store.url}/{job.path.name}"
        start = time.monotonic()
        try:
            refused = self.guard(job.path.name) if self.guard is not None else None
            if refused:
                self.stats.failed.append(job.step)
                log.warning("checkpoint.remote: %s is not uploaded to %s: %s; the local checkpoint %s is intact",
                            job.path.name, where, refused, job.path)
                return
            nbytes = upload(self.store, job.path, self._progress(job, start))
            if self.uploaded is not None:
                self.uploaded(job.path.name)
            removed = retain(self.store, self.keep_last, self.keep_every, self.protect(), self.mine)
        except Exception as err:  # noqa: BLE001 - the tier never ends training: the local checkpoint is intact
            self.stats.failed.append(job.step)
            log.warning("checkpoint.remote: upload of %s to %s failed, not committed there (its manifest was not "
                        "uploaded): %s; the local checkpoint %s is intact; the next checkpoint is uploaded again",
                        job.path.name, where, _one_line(err), job.path)
            return
        now = time.monotonic()
        self.stats.uploaded.append(job.step)
        log.info("checkpoint.remote: %s uploaded to %s (%.1f MB in %.1f s, %.0f MB/s; lag %.1f s after its local "
                 "commit; %d waiting)%s", job.path.name, where, nbytes / 1e6, now - start,
                 nbytes / 1e6 / max(now - start, 1e-9), now - job.committed_at, len(self._waiting),
                 f"; retention removed {', '.join(removed)}" if removed else "")

    def _progress(self, job: _Job, start: float) -> Callable[[int, int], None]:
        last = [start]

        def report(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S and done < total:
                last[0] = now
                log.info("checkpoint.remote: uploading %s: %.0f of %.0f MB (%.0f MB/s)", job.path.name, done / 1e6,
                         total / 1e6, done / 1e6 / max(now - start, 1e-9))
        return report

    def close(self, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for the uploads in flight; returns (and logs) the steps left
        behind (committed locally, not remotely)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while (self._waiting or self._current) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            left = sorted({job.step for job in [*self._waiting, *([self._current] if self._current else [])]})
            self._waiting.clear()  # the daemon thread ends after the upload in flight, or with the process
        not_up = sorted((set(left) | set(self.stats.failed)) - set(self.stats.uploaded))
        if left:
            log.warning("checkpoint.remote: %s not uploaded to %s within checkpoint.remote_wait_s=%g (committed "
                        "locally); the next run with this run.dir uploads its newest checkpoint at start",
                        ", ".join(layout.step_name(s) for s in left), self.store.url, timeout_s)
        elif not_up:
            log.warning("checkpoint.remote: %s not uploaded to %s (failed; committed locally); the next run with "
                        "this run.dir uploads its newest checkpoint at start",
                        ", ".join(layout.step_name(s) for s in not_up), self.store.url)
        return not_up


class RemoteTier:
    """The checkpointer's handle on ``checkpoint.remote`` (rank 0 only): the claim on the prefix,
    the resume's choice and the background uploads. Opening it lists the prefix, so wrong
    credentials, a missing bucket or an endpoint that does not answer fail the run at start
    (exit 2 / 1, one line); :meth:`claim` (at resume) refuses a prefix another run owns."""

    def __init__(self, url: str, options: Mapping[str, Any], root: Path, *, keep_last: int,
                 keep_every: int | None, queue: int, protect: Callable[[], set[int]] = set,
                 local_retention: Callable[[], None] | None = None) -> None:
        self.root = root
        self.run_dir = str(Path(root).resolve().parent)  # recorded by the claim: a restart of this run dir is this run
        self.store = open_store(url, options)
        self.remote = committed(self.store)  # the probe: credentials and bucket are checked here
        self.claimed: Claim | None = None
        self.failed: set[str] = set()  # remote checkpoints that did not download intact in this resume
        self._run_of: dict[str, str | None] = {}  # remote checkpoint -> the run id its manifest names (read once)
        self.uploader = Uploader(self.store, keep_last=keep_last, keep_every=keep_every, queue=queue,
                                 protect=protect, after=local_retention, guard=self._guard, mine=self.mine,
                                 uploaded=self._uploaded)

    @property
    def run_id(self) -> str | None:
        return self.claimed.run_id if self.claimed is not None else None

    # ---------------------------------------------------------------- one owner

    def claim(self, spec: str, local_id: str | None) -> str:
        """Take the prefix for this run (``local_id``: the run id of the run directory's
        checkpoints) or refuse it (exit 2, naming the owner); returns the run id this run's
        checkpoints carry from now on (the owner's, where this run continues it)."""
        if self.claimed is not None:
            return self.claimed.run_id
        owner = tier_owner.read_owner(self.store)
        resuming = bool(self.remote) and (spec == "auto" or spec == self.store.url
                                          or spec.startswith(f"{self.store.url}/"))
        if owner is None and local_id is None and resuming:
            local_id = self._run_of_newest()  # a record deleted by hand: continue the run the tier holds
        run_id = tier_owner.choose_run(owner, local_id=local_id, run_dir=self.run_dir, resuming=resuming,
                                       url=self.store.url, now=time.time())
        claim = Claim(self.store, run_id, self.run_dir)
        claim.take(owner)
        self.claimed = claim
        return run_id

    def _run_of_newest(self) -> str | None:
        for _, name in self.remote[::-1][:3]:  # the newest few: older ones were written by the same run
            self.mine(name)  # reads (and caches) its manifest's run id
            if self._run_of.get(name) is not None:
                return self._run_of[name]
        return None

    def mine(self, name: str) -> bool:
        """Is remote checkpoint ``name`` this run's? Its manifest names this run's id, or none (written
        before runs had ids: the owner's). One whose manifest cannot be read is nobody's: kept."""
        if name not in self._run_of:
            try:
                found = read_manifest(self.store, name).get("run_id")
            except (layout.CheckpointError, FileNotFoundError):
                return False
            self._run_of[name] = found if isinstance(found, str) else None
        return self._run_of[name] in (None, self.run_id)

    def _guard(self, name: str) -> str | None:
        """Why checkpoint ``name`` may not go up now: the prefix is not (or no longer) this
        instance's, or a committed checkpoint of that name is another run's."""
        if self.claimed is None:
            return "the prefix was not claimed (Checkpointer.resume was not called)"
        if not self.claimed.holds():
            return "another run or instance holds the prefix now"
        if self.store.exists(f"{name}/{layout.MANIFEST}") and not self.mine(name):
            return f"{self.store.url}/{name} is another run's checkpoint (or its manifest is unreadable): kept"
        return None

    def _uploaded(self, name: str) -> None:
        self._run_of[name] = self.run_id

    # ---------------------------------------------------------------- resume

    def fetch_next(self, above: int) -> Path | None:
        """Resume=auto: the newest remote checkpoint of this run past step ``above`` that the run
        directory lacks and that did not fail already, downloaded and verified into the run's
        checkpoints/ (a corrupt, crafted or another run's one is skipped, said in the log, and the
        next tried). None: the run directory's own checkpoint at ``above`` comes next."""
        local = {path.name for _, path in layout.committed(self.root)}
        newer = [(step, name) for step, name in self.remote
                 if step > above and name not in local and name not in self.failed]
        if not newer:
            return None
        log.info("checkpoint.remote: %s holds step %d, the run directory %s", self.store.url, newer[-1][0],
                 f"step {above} at most (of those not tried)" if above >= 0 else "no checkpoint to try")
        return fetch_newest(self.store, newer, self.root, self.run_id, self.failed)

    def check_past(self, step: int, spec: str) -> None:
        """After the resume (at ``step``), this run's committed remote checkpoints past it are:
        under resume=auto, corrupt ones it skipped (said; this run's saves of those steps replace
        them); under resume=PATH (a deliberate step back), an abandoned future: their markers are
        set aside (``superseded-manifest.json``, files kept) so no resume takes them; under
        resume=never, another run's: a later resume=auto would take them, so the run is refused."""
        past = [name for s, name in self.remote if s > step and (spec == "never" or self.mine(name))]
        if not past:
            return
        if spec == "auto":
            log.warning("checkpoint.remote: %s holds %s past the resume point (step %d), which could not be used; "
                        "this run's saves of those steps replace them", self.store.url, ", ".join(past), step)
            return
        if spec != "never":
            for name in past:
                self.store.write(f"{name}/{SUPERSEDED}", self.store.read(f"{name}/{layout.MANIFEST}"))
                self.store.delete(f"{name}/{layout.MANIFEST}")
            log.warning("checkpoint.remote: %s past the resume point (step %d) in %s: set aside (%s, files kept; "
                        "this run's saves of those steps replace them)", ", ".join(past), step, self.store.url,
                        SUPERSEDED)
            return
        raise UserError(f"checkpoint.remote={self.store.url} holds checkpoints past step {step} ({', '.join(past)}), "
                        f"of another run or of this one before resume={spec}: a later resume=auto would take them; "
                        f"hint: give this run its own checkpoint.remote prefix, or delete them there "
                        f"(`hpctrain ckpt list {self.store.url}`)")

    def catch_up(self) -> None:
        """At start: the run directory's newest checkpoint goes up if the tier lacks it (the
        previous job ended before its upload did)."""
        local = layout.committed(self.root)
        if local and local[-1][0] not in {step for step, _ in self.remote}:
            log.info("checkpoint.remote: %s is not in %s yet: uploading it", local[-1][1].name, self.store.url)
            self.uploader.submit(local[-1][1])

    def close(self, timeout_s: float) -> list[int]:
        try:
            return self.uploader.close(timeout_s)
        finally:
            if self.claimed is not None:
                self.claimed.release()


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__
