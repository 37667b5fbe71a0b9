"""One handle on checkpointing: resume, step-boundary hook, final save. It saves a mapping of
``Stateful`` objects (``state_dict()`` / ``load_state_dict()``) and knows no trainer and no
strategy. Usable from any loop::

    state = {"model": strategy.checkpoint_state(),   # model + optimizer, whole or sharded
             "scheduler": scheduler, "scaler": precision, "counters": counters, "loader": loader}
    ckpt = Checkpointer(run_dir, env, device, CheckpointConfig(every_steps=100), state)
    ckpt.resume("auto")
    for ...:                      # after each optimizer step (counters.step advanced)
        if ckpt.at_step(best):    # True: preempted, a checkpoint is committed: exit 3
            break
    ckpt.finish(best)

``state["model"]`` is a :class:`~hpctrain.checkpoint.view.CheckpointView` that the strategy
makes (:mod:`hpctrain.parallel.state`'s ``WholeState(model, optimizer)`` for a plain model);
it writes and reads model + optimizer in its format; ``state["counters"]`` has a ``step``. ``loader`` and ``rng``
(added when missing) are saved per rank; every other entry once, by rank 0.
"""

from __future__ import annotations

import io
import json
import logging
import math
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist

from hpctrain.checkpoint import checksum, confine, layout, remote, tensorfile, tier_owner
from hpctrain.checkpoint.policy import Schedule
from hpctrain.checkpoint.preempt import EXIT_PREEMPTED, Agreement, Preempted, SignalFlag
from hpctrain.checkpoint.remote import RemoteTier
from hpctrain.checkpoint.state import REPLICATED, REPLICATED_TENSORS, RNG, rank_file, restore, snapshot
from hpctrain.checkpoint.tier_owner import new_run_id
from hpctrain.checkpoint.view import CheckpointView, manifest_format, view_class
from hpctrain.checkpoint.writer import CheckpointWriter, default_group
from hpctrain.core import protocol as heartbeat
from hpctrain.core import safe_pickle
from hpctrain.core.atomic import atomic_write_text, write_json
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import HpctrainError, agree
from hpctrain.core.protocol import program_signals, record_preempted
from hpctrain.precision import local_max_abs

if TYPE_CHECKING:
    from hpctrain.config.checkpoint import CheckpointConfig

log = logging.getLogger("hpctrain")
T = TypeVar("T")


class Checkpointer:
    def __init__(self, run_dir: str | Path, env: ClusterEnv, device: torch.device, config: CheckpointConfig,
                 state: Mapping[str, Any], *, run_config: dict[str, Any] | None = None,
                 signals: SignalFlag | None = None) -> None:
        """``state``: Stateful objects by name (see the module doc); ``run_config``: the run's
        whole config as a dict, saved with each checkpoint and compared on resume."""
        c = config
        self.config, self.env, self.device, self.run_dir = c, env, device, Path(run_dir)
        self.state: dict[str, Any] = {"rng": RNG(device), **state}
        # checkpoint.format picks the view's format where the state can be saved that way
        self.view: CheckpointView = self.state["model"].for_format(c.format)
        self.state["model"], self.counters = self.view, self.state["counters"]
        self.root = layout.checkpoints_dir(self.run_dir)
        self.cfg_dict = dict(run_config or {})
        own = not self.view.background  # its save runs collectives on the training process group
        self.format = self.view.format
        if own and c.mode == "async" and env.is_main:
            log.info("parallel.strategy=%s: checkpoints are saved synchronously (its own save runs collectives on "
                     "the training process group), not checkpoint.mode=async", self.view.strategy)
        # Two gloo groups, created in the same order on every rank: one for the writer
        # thread's commit exchange, one for the loop's per-step agreement.
        self.group = default_group(env)
        self.agree = Agreement(env, default_group(env), c.signal_check_every)
        self.writer = CheckpointWriter(self.root, env, mode=c.mode, local_dir=c.local_dir,
                                       stagger_s=c.stagger_seconds, keep_last=c.keep_last,
                                       keep_every=c.keep_every, group=self.group, hash=c.hash)
        self.schedule = Schedule(c.every_steps, c.every_seconds, c.mtbf_hours, self.view.nbytes())
        if signals is None:  # the trainer installs its own earlier, before set-up; in a user's own
            signals = SignalFlag(program_signals(c.signals))  # program, hpctrain slurm --signal's choice wins
            signals.install()
        self.signals = signals
        self._closed = False
        # Async: parameters and optimizer state are copied by the writer thread while the
        # next forward/backward runs; the next optimizer.step() first waits for that copy.
        async_copy = c.mode == "async" and not own
        self._hook = self.view.optimizer.register_step_pre_hook(self._before_update) if async_copy else None
        self.last_saved_step = -1
        self.resumed_from: Path | None = None
        self.best: dict[str, Any] = {}
        self._best_pending: dict[str, Any] | None = None  # best.json waits for its checkpoint's commit
        self.preempted = False
        self.remote: RemoteTier | None = None  # rank 0's handle on checkpoint.remote
        self.run_id: str | None = None  # rank 0: this run's id, in every manifest it writes (whose checkpoint it is)
        self._claimed = False  # every rank alike: the remote tier's owner check has run
        # Nobody writes a new partial before the old ones are gone; one rank's failure fails all.
        agree("preparing the checkpoint directory", self._prepare)
        if self.remote is not None:
            self.writer.on_commit = self.remote.uploader.submit
            self.writer.protect = self.remote.uploader.pending

    def _prepare(self) -> None:
        """Rank 0 makes checkpoints/ and removes what killed saves and writes left in the run
        directory; the first rank of each node clears its node-local tier's leftovers."""
        if self.env.is_main:
            self._prepare_root()
            self.run_id = layout.run_id_of(self.root)  # a run that goes on keeps its id
            self.remote = self._open_remote()
            if self.remote is None:
                self.run_id = self.run_id or new_run_id()
        if self.env.local_rank == 0:
            self.writer.remove_local_leftovers()

    def _open_remote(self) -> RemoteTier | None:
        """checkpoint.remote, opened (and its credentials and bucket checked) by rank 0."""
        c = self.config
        if c.remote is None:
            return None
        try:
            return RemoteTier(c.remote, c.storage_options, self.root, keep_last=c.remote_keep_last or c.keep_last,
                              keep_every=c.keep_every, queue=c.remote_queue,
                              protect=self._best_step, local_retention=self._local_retention)
        except HpctrainError as err:  # the store's own one line (credentials: exit 2), named as the key's
            raise type(err)(f"checkpoint.remote: {err}") from None

    def _local_retention(self) -> None:
        """After an upload: the local tier's retention, which kept the checkpoint while it waited."""
        c = self.config
        if self.remote is not None:
            layout.apply_retention(self.root, c.keep_last, c.keep_every, self.remote.uploader.pending())

    def _best_step(self) -> set[int]:
        """The step best.json names: the remote retention keeps it, as the local one does."""
        best = layout.best_step(self.root)
        return set() if best is None else {best}

    def _prepare_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise layout.CheckpointError(f"cannot create {self.root}: {err}; hint: check run.dir permissions") from err
        layout.remove_partials(self.root)
        layout.remove_stale_temps(self.root, layout.BEST_FILE)
        layout.remove_stale_temps(self.run_dir, "model.pt")  # weights.save_model_streamed writes RUN_DIR/model.pt

    # ---------------------------------------------------------------- resume

    def resume(self, spec: str) -> bool:
        """``auto``: newest intact checkpoint of the run dir (if any); ``never``; or a PATH.
        Rank 0 lists the candidates; every rank reads and checks its files in one pass; all
        ranks agree on the outcome of each phase, so one rank's failure fails every rank
        (never a hang). Returns True if state was restored. The phase is watched: ``hpctrain
        run``'s watchdog judges it (a long phase), and a preemption signal ends it at once
        (:class:`~hpctrain.checkpoint.preempt.Preempted`, exit 3: nothing new to save)."""
        resumed = False
        self._claim(spec)
        if spec != "never":
            with heartbeat.during(heartbeat.RESUMING), \
                    self.signals.interrupting("the resume", self._preempted_in_resume):
                resumed = self._resume(spec)
        # every rank alike: a tier holding a newer run's checkpoints is refused before training (the
        # config, not self.remote, decides: only rank 0 holds the uploader; no tier, no collective)
        if self.config.remote is not None:
            agree("checking checkpoint.remote", lambda: self.remote.check_past(self.counters.step, spec)
                  if self.remote is not None else None)
        if self.remote is not None and spec == "auto":
            self.remote.catch_up()  # what the previous job left un-uploaded goes up now
        return resumed

    def _claim(self, spec: str) -> None:
        """Every rank alike: rank 0 takes the remote tier for this run, or a prefix another run owns
        is refused (exit 2, naming it) before anything is downloaded, uploaded or deleted there."""
        if self._claimed or self.config.remote is None:
            return
        self._claimed = True
        agree("claiming checkpoint.remote", lambda: self._claim_main(spec) if self.remote is not None else None)

    def _claim_main(self, spec: str) -> None:
        assert self.remote is not None
        try:
            self.run_id = self.remote.claim(spec, self.run_id)
        except HpctrainError as err:
            if isinstance(err, tier_owner.TierOwnedError):
                raise
            raise type(err)(f"checkpoint.remote: {err}") from None  # the store's own one line, named as the key's

    def _preempted_in_resume(self, err: Preempted) -> None:
        if self.env.is_main:
            log.warning("%s during the resume: nothing new to save, exit %d; the same command resumes again",
                        err.signal_name, EXIT_PREEMPTED)

    def _resume(self, spec: str) -> bool:
        """One candidate at a time (rank 0 chooses, every rank reads it): a corrupt or crafted one
        is skipped under resume=auto and the next one, of either tier, tried."""
        tried: list[str] = []
        skipped: list[str] = []
        while True:
            chosen = self._decided("choosing the checkpoint to resume", lambda: self._next_candidate(spec, tried))
            if chosen is None:
                break
            path = Path(chosen)
            tried.append(chosen)
            loaded, problems = self._read_everywhere(path)
            if not problems:
                self._restore(path, loaded)
                return True
            if spec != "auto":
                raise layout.CheckpointError(f"resume={spec}: checkpoint {path} is corrupt: {'; '.join(problems)}; "
                                             f"hint: `hpctrain ckpt verify {path}`")
            if self.env.is_main:
                log.warning("checkpoint %s is corrupt and is skipped: %s", path, "; ".join(problems))
            skipped.append(f"{path.name} ({problems[0]})")
        if tried:  # the corrupt ones were read into the live model: starting fresh is no option
            raise layout.CheckpointError(
                f"no intact checkpoint in {self.root}: all {len(tried)} are corrupt: {'; '.join(skipped)}; "
                f"hint: `hpctrain ckpt verify {self.run_dir}`, move the corrupt ones aside, or start over with "
                "resume=never run.overwrite=true")
        return False

    def _next_candidate(self, spec: str, tried: list[str]) -> str | None:
        """Rank 0: the next checkpoint to try, newest first. resume=auto: the run directory's, and
        with a remote tier first any newer one of this run there (downloaded into checkpoints/; one
        that does not download intact is skipped for the next); resume=PATH or URL: the one it names."""
        if spec != "auto":
            return None if tried else str(self._candidates(spec)[0])
        local = [p for p in layout.candidates("auto", self.root) if str(p) not in tried]
        if self.remote is not None:
            fetched = self.remote.fetch_next((layout.step_of(local[0]) or 0) if local else -1)
            if fetched is not None:
                return str(fetched)
        return str(local[0]) if local else None

    def _candidates(self, spec: str) -> list[Path]:
        """Rank 0, resume=PATH or URL: the checkpoints it names, newest first (a URL's downloaded
        into this run's checkpoints/)."""
        if remote.is_remote(spec):  # resume=s3://B/PREFIX[/step-N]: downloaded into this run's checkpoints/
            store, entries = remote.resolve_url(spec, self.config.storage_options, "resume")
            path = remote.fetch_newest(store, entries, self.root)
            if path is None:
                raise layout.NoCheckpointError(f"resume={spec} holds no intact committed checkpoint; hint: "
                                               f"`hpctrain ckpt list {spec}`")
            return [path]
        return layout.candidates(spec, self.root)

    def _read_everywhere(self, path: Path) -> tuple[Any, list[str]]:
        """Every rank reads (and checks) its files of ``path``. Returns this rank's state and
        the problems every rank found (the same list on all ranks: all skip alike). An
        unexpected error on one rank fails all ranks alike."""
        problems, loaded = agree(f"reading checkpoint {path}", lambda: self._read(path))
        return loaded, [p for rank_problems in self._all_gather(problems) for p in rank_problems]

    def _read(self, path: Path) -> tuple[list[str], Any]:
        """This rank's files of ``path``, each read once and checked against the manifest
        while it is read (the model's bytes straight into the live parameters), from the
        node-local copy where it has them and they match. Returns (problems, (replicated,
        per_rank)); corruption (and a crafted file) is a problem, not an error; a file that
        cannot be read is an error (fix the permissions; nothing is skipped)."""
        copies = Copies(path, self._local_copy(path))
        try:
            manifest = layout.read_manifest(path)
            files = manifest["files"]
            saved = self._check_format(path, manifest)
            same_world = manifest.get("world_size") == self.env.world_size
            # a whole model in the replicated files: its bytes go straight into the live tensors
            live = self.view.live_tensors() if saved.files_dir is None else None
            replicated = load_replicated(path, _named_model(live), files, copies)
            per_rank = copies.read(rank_file(self.env.rank if same_world else 0), lambda p: load_file(p, files))
            self._verify_own(path, files, saved)
        except layout.UnreadableCheckpointError:
            raise
        except (layout.CheckpointError, tensorfile.TensorFileError, safe_pickle.UnsafePickleError) as err:
            return [str(err)], None
        copies.log_source()
        return [], (replicated, per_rank)

    def _local_copy(self, path: Path) -> Path | None:
        """Where the two-tier writer keeps its node-local copy of ``path`` (one of this run's
        checkpoints), present or not; None without a node-local tier."""
        local = self.writer.local
        if local is None or path.parent.resolve() != self.root.resolve():
            return None
        return local / path.name

    def _check_format(self, path: Path, manifest: dict[str, Any]) -> type[CheckpointView]:
        """The view class of the checkpoint's format (its manifest's, not the config's: a sharded
        checkpoint may load into a whole model, and the reverse), once the running view says it
        can load it (the format, the world size that wrote it). Bad input: raised (every rank
        alike, before training), not skipped as corrupt."""
        self.view.check_resume(path, manifest, self.env.world_size)
        return view_class(manifest_format(manifest))

    def _verify_own(self, path: Path, files: dict[str, Any], saved: type[CheckpointView]) -> None:
        """A format's own files are read by its own reader, so they are hashed (and checked by
        the view class) before it does (two passes); each rank takes a share of the files."""
        mine = saved.own_files(files)[self.env.rank :: self.env.world_size]
        for name in mine:  # only regular files inside the checkpoint, read no further than their size
            _check_entry(path / name, files[name], lambda file, algorithm: layout.hash_file(file, algorithm, path))
        if saved.files_dir is not None:
            saved.check_files(path, set(mine))  # what a checksum cannot vouch for (a pickle's contents)

    def _restore(self, path: Path, loaded: tuple[dict[str, Any], dict[str, Any]]) -> None:
        replicated, per_rank = loaded
        manifest = layout.read_manifest(path)
        replicated = self.view.load(path, manifest, replicated, self.group)  # model + optimizer; agreed in there
        self.best = agree(f"restoring checkpoint {path}", lambda: restore(
            self.state, replicated, per_rank, self.env, self.cfg_dict, source=path))
        self.resumed_from = path
        if path.parent.resolve() == self.root.resolve():
            self.writer.last_committed = path
        self.last_saved_step = self.counters.step
        agree("recording the resume", lambda: self._record_resume(path) if self.env.is_main else None)

    def _record_resume(self, path: Path) -> None:
        """Rank 0: newer checkpoints set aside, metrics rows past the checkpoint dropped."""
        layout.set_aside(self.root, self.counters.step)
        log.info("resumed from %s (step %d, epoch %d)", path, self.counters.step, self.counters.epoch)
        _trim_metrics(self.run_dir / "metrics.jsonl", self.counters.step)

    # ---------------------------------------------------------------- the loop's hook

    def at_step(self, best: dict[str, Any]) -> bool:
        """At a step boundary: save if a schedule or a signal says so. True = stop now
        (preempted; the checkpoint is committed)."""
        step = self.counters.step
        signal_seen, timer_due = self.signals.received is not None, self.schedule.time_due()
        if self.agree.distributed:  # every rank decides alike (one small all-reduce, every few steps)
            signal_seen, timer_due = self.agree(step, signal_seen, timer_due)
        if signal_seen:
            self.save(best, blocking=True)
            self.preempted = True
            record_preempted()  # under hpctrain run: the launcher then exits 3 for any program
            return True
        if timer_due or self.schedule.step_due(step):
            self.save(best)
        return False

    def save(self, best: dict[str, Any], *, blocking: bool = False) -> None:
        with heartbeat.during(heartbeat.SAVING):  # the watchdog's long allowance: a real save, not the agreement
            self._save(best, blocking)

    def _save(self, best: dict[str, Any], blocking: bool) -> None:
        step = self.counters.step
        if step == self.last_saved_step:
            if blocking:
                self._settle()
            return
        self._settle()  # the save in flight commits (or raises) before the next starts; best.json follows it
        self._claim("never")  # a loop that never called resume(): a fresh start, claimed before its first upload
        if not self._weights_finite(step):
            return  # never written, so never best, and retention keeps the last finite checkpoint
        snap = snapshot(self.state, self.env, self.cfg_dict, best)
        snap.info["finite"] = True  # checked: retention never deletes the newest checkpoint so marked
        if self.run_id is not None:  # rank 0's: whose checkpoint it is (the remote tier's retention reads it)
            snap.info["run_id"] = self.run_id
        if best.get("step") == step:
            snap.info["best"] = dict(best)
        if best.get("step") == step:
            self._best_pending = dict(best)
        self.writer.save(snap, blocking=blocking, defer=self.view.step_storages() if self._hook else None)
        self.last_saved_step = step
        self.schedule.saved(self.writer.last.stall_s, max(self.writer.last.total_s, self.writer.last.stall_s))
        if blocking or not self.writer.busy():
            self._settle()

    def _weights_finite(self, step: int) -> bool:
        """Are the model's parameters and buffers finite on every rank? One pass over this rank's
        tensors (its shards) per save, and with several ranks one small all-reduce on the loop's
        agreement group, so every rank skips (or saves) alike. False is logged (rank 0)."""
        module = self.view.checked_module()
        if not isinstance(module, torch.nn.Module):
            return True  # a view that holds no module of its own: nothing to check
        tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
        largest = local_max_abs(tensors).cpu().reshape(1)
        if self.agree.distributed:
            dist.all_reduce(largest, group=self.agree.group)  # a sum: nan or inf on one rank is everywhere
        value = float(largest[0])
        if math.isfinite(value):
            return True
        if self.env.is_main:
            log.warning("checkpoint at step %d not written: the model's weights are not finite (largest magnitude "
                        "%s); the last checkpoint written stays the newest", step, value)
        return False

    def note_best(self, best: dict[str, Any]) -> None:
        """Validation found a new best at the current step: mark (or save) its checkpoint.
        best.json names it only once that checkpoint is committed."""
        self.best = dict(best)
        if self.last_saved_step == best.get("step"):
            self._best_pending = dict(best)
            if not self.writer.busy():
                self._settle()
        elif self.config.on_best:
            self.save(best)

    def _settle(self) -> None:
        """Wait for the save in flight (its error is raised here), then write best.json if
        the best validation's checkpoint is now committed. An async save that fails is
        therefore never named by best.json or the summary."""
        committed = self.writer.wait()
        pending, self._best_pending = self._best_pending, None
        if pending is None:
            return
        name = layout.step_name(int(pending["step"]))
        if committed is None or committed.name != name:
            self._best_pending = pending  # its save has not started yet (note_best before save)
            return
        if self.env.is_main:
            write_json(self.root / layout.BEST_FILE, {**pending, "checkpoint": name})

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.writer.wait_staged()

    def finish(self, best: dict[str, Any]) -> None:
        """End of training: the final save (``checkpoint.at_end``), committed before return."""
        if self.config.at_end:
            self.save(best, blocking=True)

    @property
    def exit_code(self) -> int:
        """What the process should exit with: ``EXIT_PREEMPTED`` (3: saved on a preemption
        signal; the launcher or Slurm's requeue runs the same command again) or 0."""
        return EXIT_PREEMPTED if self.preempted else 0

    def close(self) -> Path | None:
        """Wait for the save in flight (its error is raised here) and stop the writer thread."""
        if self._closed:
            return self.writer.last_committed
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        try:
            self._settle()
            return self.writer.last_committed
        finally:
            try:
                self.writer.close()
            finally:
                if self.remote is not None:  # rank 0: the last upload, bounded (the watchdog: a long phase)
                    with heartbeat.during(heartbeat.SAVING):
                        self.remote.close(self.config.remote_wait_s)

    def abandon(self) -> None:
        """On an error in the loop: finish the save in flight, but let the loop's error win."""
        try:
            self.close()
        except Exception as err:
            log.error("checkpoint: the save in flight failed too: %s", err)

    def best_record(self, best: dict[str, Any]) -> dict[str, Any]:
        """``best`` plus the name of its checkpoint, when one was saved at that step."""
        marked = layout.best_step(self.root)
        if best and marked is not None and marked == best.get("step"):
            return {**best, "checkpoint": layout.step_name(marked)}
        return best

    # ---------------------------------------------------------------- collectives

    def _decided(self, phase: str, decide: Callable[[], T]) -> T:
        """Rank 0 decides, the others wait for its outcome: rank 0's error is raised on every
        rank (by ``agree``) instead of leaving them in the broadcast."""
        value: T | None = agree(phase, lambda: decide() if self.env.is_main else None)
        if self._distributed():
            box = [value]
            dist.broadcast_object_list(box, src=0, group=self.group)
            value = box[0]
        return cast(T, value)

    def _all_gather(self, value: Any) -> list[Any]:
        if not self._distributed():
            return [value]
        out: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _distributed(self) -> bool:
        return self.env.distributed and dist.is_initialized()


def _named_model(live: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """The model's live tensors under the names the replicated file gives them."""
    return tensorfile.split({"model": live})[1] if live is not None else None


class Copies:
    """Where a checkpoint's files are read from: the two-tier writer's node-local copy
    (``local``) where it holds the file and the file matches the manifest, else the shared
    checkpoint directory. A local file that does not match is logged and read from shared."""

    def __init__(self, shared: Path, local: Path | None = None) -> None:
        self.shared, self.local = shared, local
        self.from_local: list[str] = []

    def read(self, name: str, read: Callable[[Path], T]) -> T:
        if self.local is not None and (self.local / name).is_file():
            try:
                value = read(self.local / name)
            except (layout.CheckpointError, tensorfile.TensorFileError, safe_pickle.UnsafePickleError) as err:
                log.warning("checkpoint: the node-local copy %s does not match %s (%s): reading the shared copy",
                            self.local / name, self.shared / layout.MANIFEST, err)
            else:
                self.from_local.append(name)
                return value
        return read(self.shared / name)

    def log_source(self) -> None:
        """Say which copy was read (two-tier only)."""
        if self.local is None:
            return
        if self.from_local:
            log.info("checkpoint %s: read %s from the node-local copy %s (verified against the manifest of %s)",
                     self.shared.name, ", ".join(self.from_local), self.local, self.shared)
        else:
            log.info("checkpoint %s: no node-local copy in %s matches it: read from the shared %s", self.shared.name,
                     self.local, self.shared)


def load_replicated(path: Path, into: dict[str, torch.Tensor] | None = None,
                    files: dict[str, Any] | None = None, copies: Copies | None = None) -> dict[str, Any]:
    """The replicated state tree of a checkpoint; tensors whose live counterpart is given
    in ``into`` (by name) are read straight into it. With ``files`` (the manifest's
    entries) every file is checked against its size and checksum in the same pass.
    ``copies``: where each file is read from (default: ``path``)."""
    copies = copies or Copies(path)
    skeleton = copies.read(REPLICATED, lambda p: load_file(p, files))
    tensors_file = path / REPLICATED_TENSORS
    if not tensors_file.is_file():
        if files is not None and REPLICATED_TENSORS in files:
            raise layout.CheckpointError(f"{tensors_file}: missing")
        return skeleton  # nothing but small values (a view with files of its own keeps model and optimizer there)
    tensors = copies.read(REPLICATED_TENSORS, lambda p: _read_tensors(p, into, files))
    return tensorfile.join(skeleton, tensors)


def _read_tensors(path: Path, into: dict[str, torch.Tensor] | None,
                  files: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    expect = _entry(files, path)
    try:
        return tensorfile.read(path, into, expect, root=path.parent)
    except (tensorfile.TensorFileError, layout.CheckpointError):
        raise
    except OSError as err:
        raise layout.unreadable(path, err) from err
    except (KeyError, TypeError, ValueError) as err:
        raise layout.CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err})") from err


def load_file(path: Path, files: dict[str, Any] | None = None) -> dict[str, Any]:
    """A small checkpoint file (skeleton, per-rank state): read once, checked against its
    manifest entry when ``files`` is given, checked against safe_pickle's limits (nesting,
    size, zip bomb: a consistent manifest proves nothing), then unpickled from memory with
    ``weights_only``. Only a regular file of the checkpoint directory is read, its size
    compared with the manifest's (and with :data:`confine.MAX_WHOLE`) before a byte is read."""
    expect = _entry(files, path)
    try:
        data = _read_small(path, expect)
    except confine.MissingFileError:
        raise layout.CheckpointError(f"{path} is missing; hint: `hpctrain ckpt verify {path.parent}`") from None
    except OSError as err:
        raise layout.unreadable(path, err) from err
    if expect is not None:
        _check_entry(path, expect, lambda _, algorithm: checksum.hash_bytes(data, algorithm))
    safe_pickle.check_torch_archive(data, str(path))
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # weights_only refused what the file names: never written here
        raise safe_pickle.UnsafePickleError(
            f"{path} holds objects a checkpoint never holds: refused without running them "
            f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); hint: the file was not written by "
            "this program (crafted or from another tool): do not use it") from err
    except Exception as err:
        raise layout.CheckpointError(f"{path} cannot be loaded ({type(err).__name__}: {err})") from err


def _read_small(path: Path, expect: dict[str, Any] | None) -> bytes:
    """The bytes of a file read whole (a FIFO, a device, a symlink out of the checkpoint, a size
    other than the manifest's or a huge one: refused before reading)."""
    fh, size = confine.open_regular(path, path.parent)
    with fh:
        if expect is not None and size != expect["size"]:
            raise layout.CheckpointError(checksum.mismatch(expect, {"size": size}, path) or f"{path}: size {size}")
        if size > confine.MAX_WHOLE:
            raise confine.RefusedFileError(f"{path} holds {size:,} bytes, more than the {confine.MAX_WHOLE:,} a "
                                           "checkpoint's skeleton or per-rank state ever holds: refused before reading")
        return confine.read_at_most(fh, size)


def _entry(files: dict[str, Any] | None, path: Path) -> dict[str, Any] | None:
    if files is None:
        return None
    entry = files.get(path.name)
    if not isinstance(entry, dict):
        raise layout.CheckpointError(f"{path.name} is not listed in {path.parent / layout.MANIFEST}")
    return entry


def _check_entry(path: Path, expect: dict[str, Any], hasher: layout.Hasher) -> None:
    """``path`` against its manifest entry, hashed with the algorithm the entry names."""
    algorithm = checksum.of_entry(expect) or checksum.resolve(checksum.DEFAULT)  # none: mismatch() names it
    try:
        got = hasher(path, algorithm)
    except OSError as err:
        raise layout.unreadable(path, err) from err
    problem = checksum.mismatch(expect, got, path)
    if problem:
        raise layout.CheckpointError(problem)


def _trim_metrics(path: Path, step: int) -> None:
    """Rows logged after the checkpoint will be logged again by the resumed run."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) > step:
                continue
        except ValueError:
            continue  # a line cut by the crash
        keep.append(line)
    atomic_write_text(path, "".join(f"{line}\n" for line in keep))
