"""The trainer's one handle on checkpointing: resume, step-boundary hook, final save.

Usable from a hand-written loop too::

    ckpt = Checkpointer(cfg, env, device, run_dir, parts)
    ckpt.resume(cfg.resume)
    for ...:                      # after each optimizer step
        if ckpt.at_step(best):    # True: preempted, a checkpoint is committed
            break
    ckpt.finish(best)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.checkpoint import layout, tensorfile
from hpctrain.checkpoint.policy import Schedule
from hpctrain.checkpoint.preempt import Agreement, SignalFlag
from hpctrain.checkpoint.state import (
    REPLICATED,
    REPLICATED_TENSORS,
    SHARDED_DIR,
    rank_file,
    restore,
    restore_sharded,
    snapshot,
)
from hpctrain.checkpoint.writer import CheckpointWriter, default_group
from hpctrain.config import Config, to_dict
from hpctrain.env import ClusterEnv

log = logging.getLogger("hpctrain")


class Checkpointer:
    def __init__(self, cfg: Config, env: ClusterEnv, device: torch.device, run_dir: Path, parts: Any,
                 signals: SignalFlag | None = None) -> None:
        c = cfg.checkpoint
        self.cfg, self.env, self.device, self.run_dir, self.parts = cfg, env, device, Path(run_dir), parts
        self.root = layout.checkpoints_dir(self.run_dir)
        self.cfg_dict = to_dict(cfg)
        # Two gloo groups, created in the same order on every rank: one for the writer
        # thread's commit exchange, one for the loop's per-step agreement.
        self.group = default_group(env)
        self.agree = Agreement(env, default_group(env), c.signal_check_every)
        self.writer = CheckpointWriter(self.root, env, mode=c.mode, local_dir=c.local_dir,
                                       stagger_s=c.stagger_seconds, keep_last=c.keep_last,
                                       keep_every=c.keep_every, group=self.group)
        self.schedule = Schedule(c.every_steps, c.every_seconds, c.mtbf_hours, _state_bytes(parts))
        if signals is None:  # the trainer installs its own earlier, before set-up
            signals = SignalFlag(c.signals)
            signals.install()
        self.signals = signals
        self._closed = False
        # Async: parameters and optimizer state are copied by the writer thread while the
        # next forward/backward runs; the next optimizer.step() first waits for that copy.
        self._hook = parts.optimizer.register_step_pre_hook(self._before_update) if c.mode == "async" else None
        self.last_saved_step = -1
        self.resumed_from: Path | None = None
        self.best: dict[str, Any] = {}
        self.preempted = False
        if env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            layout.remove_partials(self.root)
        self._barrier()  # nobody writes a new partial before the old ones are gone

    # ---------------------------------------------------------------- resume

    def resume(self, spec: str) -> bool:
        """``auto``: newest committed checkpoint of the run dir (if any); ``never``; or a PATH.
        Rank 0 picks and verifies, every rank loads. Returns True if state was restored."""
        if spec == "never":
            return False
        chosen = self._pick(spec) if self.env.is_main else None
        chosen = self._broadcast(chosen)
        if chosen is None:
            return False
        self.best = self._load(Path(chosen))
        self.resumed_from = Path(chosen)
        if Path(chosen).parent.resolve() == self.root.resolve():
            self.writer.last_committed = Path(chosen)
        if self.env.is_main:
            layout.set_aside(self.root, self.parts.counters.step)
        self.last_saved_step = self.parts.counters.step
        if self.env.is_main:
            log.info("resumed from %s (step %d, epoch %d)", chosen, self.parts.counters.step,
                     self.parts.counters.epoch)
            _trim_metrics(self.run_dir / "metrics.jsonl", self.parts.counters.step)
        return True

    def _pick(self, spec: str) -> str | None:
        if spec == "auto":
            found = layout.newest_valid(self.root)
            if found is None and layout.committed(self.root):
                log.warning("no intact checkpoint in %s: starting from scratch", self.root)
            return str(found.path) if found else None
        path = layout.resolve(spec)
        problems = layout.verify(path)
        if problems:
            raise layout.CheckpointError(f"resume={spec}: checkpoint {path} is corrupt: {'; '.join(problems)}")
        return str(path)

    def _load(self, path: Path) -> dict[str, Any]:
        manifest = layout.read_manifest(path)
        same_world = manifest.get("world_size") == self.env.world_size
        mine = rank_file(self.env.rank if same_world else 0)
        replicated = load_replicated(path, live_tensors(self.parts))
        per_rank = load_file(path / mine)
        if manifest.get("format") == "dcp":
            restore_sharded(self.parts, path / SHARDED_DIR, self.group)
        return restore(self.parts, replicated, per_rank, self.env, self.device, self.cfg_dict)

    # ---------------------------------------------------------------- the loop's hook

    def at_step(self, best: dict[str, Any]) -> bool:
        """At a step boundary: save if a schedule or a signal says so. True = stop now
        (preempted; the checkpoint is committed)."""
        step = self.parts.counters.step
        signal_seen, timer_due = self.agree(step, self.signals.requested, self.schedule.time_due())
        if signal_seen:
            self.save(best, blocking=True)
            self.preempted = True
            return True
        if timer_due or self.schedule.step_due(step):
            self.save(best)
        return False

    def save(self, best: dict[str, Any], *, blocking: bool = False) -> None:
        step = self.parts.counters.step
        if step == self.last_saved_step:
            if blocking:
                self.writer.wait()
            return
        snap = snapshot(self.parts, self.env, self.device, self.cfg_dict, best, self.cfg.checkpoint.format)
        if best.get("step") == step:
            snap.info["best"] = dict(best)
        self.writer.save(snap, blocking=blocking, defer=_updated_by_step(self.parts) if self._hook else None)
        if blocking:
            self.writer.wait()
        self.last_saved_step = step
        self.schedule.saved(self.writer.last.stall_s, max(self.writer.last.total_s, self.writer.last.stall_s))
        if best.get("step") == step:
            self._mark_best(best)

    def note_best(self, best: dict[str, Any]) -> None:
        """Validation found a new best at the current step: mark (or save) its checkpoint."""
        self.best = dict(best)
        if self.last_saved_step == best.get("step"):
            self._mark_best(best)
        elif self.cfg.checkpoint.on_best:
            self.save(best)

    def _mark_best(self, best: dict[str, Any]) -> None:
        if self.env.is_main:
            from hpctrain.rundir import write_json

            name = layout.step_name(int(best["step"]))
            write_json(self.root / layout.BEST_FILE, {**best, "checkpoint": name})

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.writer.wait_staged()

    def finish(self, best: dict[str, Any]) -> None:
        """End of training: the final save (``checkpoint.at_end``), committed before return."""
        if self.cfg.checkpoint.at_end:
            self.save(best, blocking=True)

    def close(self) -> Path | None:
        """Wait for the save in flight (its error is raised here) and stop the writer thread."""
        if self._closed:
            return self.writer.last_committed
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        try:
            return self.writer.wait()
        finally:
            self.writer.close()

    def abandon(self) -> None:
        """On an error in the loop: finish the save in flight, but let the loop's error win."""
        try:
            self.close()
        except Exception as err:
            log.error("checkpoint: the save in flight failed too: %s", err)

    def best_record(self, best: dict[str, Any]) -> dict[str, Any]:
        """``best`` plus the name of its checkpoint, when one was saved at that step."""
        marked = layout.best_step(self.root)
        if best and marked == best.get("step"):
            return {**best, "checkpoint": layout.step_name(marked)}
        return best

    # ---------------------------------------------------------------- collectives

    def _broadcast(self, value: str | None) -> str | None:
        if not self.env.distributed or not dist.is_initialized():
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _barrier(self) -> None:
        if self.env.distributed and dist.is_initialized():
            dist.barrier(group=self.group)


def load_replicated(path: Path, into: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The replicated state tree of a checkpoint; tensors whose live counterpart is given
    in ``into`` (by name) are read straight into it."""
    skeleton = load_file(path / REPLICATED)
    tensors_file = path / REPLICATED_TENSORS
    if not tensors_file.is_file():
        return skeleton  # nothing but small values (format=dcp keeps model and optimizer apart)
    try:
        tensors = tensorfile.read(tensors_file, into)
    except (OSError, KeyError, ValueError, tensorfile.TensorFileError) as err:
        raise layout.CheckpointError(f"{tensors_file} cannot be read ({err})") from err
    return tensorfile.join(skeleton, tensors)


def live_tensors(parts: Any) -> dict[str, torch.Tensor]:
    """The model's live tensors under the names the replicated file gives them."""
    from hpctrain.parallel import unwrap

    return tensorfile.split({"model": unwrap(parts.model).state_dict()})[1]


def load_file(path: Path) -> dict[str, Any]:
    """A checkpoint file, memory-mapped (tensors are copied into live ones on restore)."""
    if not path.is_file():
        raise layout.CheckpointError(f"{path} is missing; hint: `hpctrain ckpt verify {path.parent}`")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise layout.CheckpointError(f"{path} cannot be loaded ({type(err).__name__}: {err})") from err


def _updated_by_step(parts: Any) -> set[int]:
    """Storages that only ``optimizer.step()`` changes: parameters and optimizer state.
    (Buffers such as BatchNorm statistics change in forward: they are copied at once.)"""
    ptrs = {p.data_ptr() for p in parts.model.parameters()}
    for state in parts.optimizer.state.values():
        ptrs |= {v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor)}
    return ptrs


def _state_bytes(parts: Any) -> int:
    tensors = list(parts.model.parameters())
    for state in parts.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _trim_metrics(path: Path, step: int) -> None:
    """Rows logged after the checkpoint will be logged again by the resumed run."""
    if not path.is_file():
        return
    from hpctrain.rundir import atomic_write_text

    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) > step:
                continue
        except ValueError:
            continue  # a line cut by the crash
        keep.append(line)
    atomic_write_text(path, "".join(f"{line}\n" for line in keep))
