"""Checkpoints for a training loop you already have (the PyTorch tutorial's, say), in three lines:

    sampler = hpctrain.ResumableSampler(train_set, seed=1)          # was DistributedSampler(train_set)
    ckpt = hpctrain.LoopCheckpoint("runs/x", model, optimizer, scheduler, train_loader, every_steps=100)
    for epoch in range(ckpt.resume(first_epoch=1), epochs + 1):     # was range(1, epochs + 1)
        sampler.set_epoch(epoch)
        train(...)                                                  # unchanged

It hooks ``optimizer.step()``: after each step it counts the step and the epoch's batches,
saves on its schedule (``every_steps``, ``every_seconds``) through hpctrain's committed,
checksummed checkpoints, and on a preemption signal (SIGUSR1, SIGTERM; ``hpctrain slurm
--signal``'s choice) every rank saves the same step and the process exits 3, which `hpctrain
run` and `hpctrain slurm` turn into a requeue. ``resume()`` restores model, optimizer,
scheduler, step, the epoch's position and every rank's random streams from the newest intact
checkpoint, so the resumed run ends with the uninterrupted run's weights, bit for bit.

A plain model or DDP; for FSDP / ZeRO use :class:`~hpctrain.checkpoint.Checkpointer` with a
strategy's state view. One optimizer step per batch (gradient accumulation: ``batches_per_step``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpctrain.checkpoint.checkpointer import Checkpointer
from hpctrain.checkpoint.state import RNG, Counters
from hpctrain.config.checkpoint import CheckpointConfig
from hpctrain.core.env import detect
from hpctrain.core.errors import EXIT_PREEMPTED, UserError
from hpctrain.data.sampler import ResumableSampler
from hpctrain.parallel import checkpoint_formats  # noqa: F401  # every format's view, for resume's format check
from hpctrain.parallel.state import WholeState


class _Position:
    """Where this rank is in its epoch (a per-rank Stateful: saved as the checkpoint's loader)."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.batches_done = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batches_done = state["epoch"], int(state["batches_done"])


class _DeferredRNG(RNG):
    """The random streams, put back when the resumed epoch's first batch is drawn rather than at
    ``resume()``: in between, the loop makes its DataLoader iterator, which draws a seed from the
    global stream. The uninterrupted run drew that seed before the checkpoint; drawn again after
    the restore, it would shift every later dropout mask. Put back at each pass the loop begins
    until training goes on (:meth:`done`): a stray ``iter()`` before the training pass draws its
    seed too, and the training pass must start from the saved streams all the same."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.pending: dict[str, Any] | None = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = state

    def apply(self) -> None:
        if self.pending is not None:
            super().load_state_dict(self.pending)

    def done(self) -> None:
        self.pending = None


class LoopCheckpoint:
    """See the module's doc. ``loader``: the training DataLoader, its sampler a
    :class:`~hpctrain.ResumableSampler` (None: resume at epoch boundaries only)."""

    def __init__(self, run_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, loader: Any = None, *, every_steps: int | None = None,
                 every_seconds: str | None = "3600", batches_per_step: int = 1,
                 config: CheckpointConfig | None = None) -> None:
        self.sampler = getattr(loader, "sampler", None) if loader is not None else None
        if loader is not None and not isinstance(self.sampler, ResumableSampler):
            raise UserError(f"LoopCheckpoint: the loader's sampler is a {type(self.sampler).__name__}, which cannot "
                            "resume mid-epoch; hint: DataLoader(dataset, sampler=hpctrain.ResumableSampler(dataset), "
                            "...) (DistributedSampler's arguments)")
        self.samples_per_step = batches_per_step * (loader.batch_size if loader is not None else 0)
        self.counters, self.position = Counters(), _Position()
        device = next(model.parameters()).device
        self.rng = _DeferredRNG(device)
        state: dict[str, Any] = {"model": WholeState(model, optimizer), "counters": self.counters,
                                 "loader": self.position, "rng": self.rng}
        if scheduler is not None:
            state["scheduler"] = scheduler
        config = config or CheckpointConfig(every_steps=every_steps, every_seconds=every_seconds)
        self.checkpointer = Checkpointer(run_dir, detect(), device, config, state)
        self._hook = optimizer.register_step_post_hook(self._after_step)

    def resume(self, first_epoch: int = 0) -> int:
        """Restore the newest intact checkpoint of the run directory, if there is one; the epoch
        to continue with (the saved one, whose pass starts after the batches it trained; or
        ``first_epoch`` when there is nothing to resume)."""
        if not self.checkpointer.resume("auto"):
            return first_epoch
        epoch = self.position.epoch
        if isinstance(self.sampler, ResumableSampler) and epoch is not None:
            skip = self.position.batches_done * self.samples_per_step
            self.sampler.resume_at(epoch, skip, then=self.rng.apply, until_done=True)  # until _after_step
        else:
            self.rng.apply()
            self.rng.done()
        return first_epoch if epoch is None else int(epoch)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.rng.pending is not None:  # the first step after a resume: the training pass holds the position
            self.rng.done()
            if isinstance(self.sampler, ResumableSampler):
                self.sampler.resume_done()
        self.counters.step += 1
        epoch = self.sampler.epoch if isinstance(self.sampler, ResumableSampler) else None
        if epoch != self.position.epoch:
            self.position.epoch, self.position.batches_done = epoch, 0
        self.position.batches_done += 1
        if self.checkpointer.at_step({}):  # preempted: every rank saved this step
            self.close()
            raise SystemExit(EXIT_PREEMPTED)  # `hpctrain run` / Slurm's requeue runs the same command again

    def close(self) -> None:
        """Wait for a save in flight and stop the writer (also at the end of training)."""
        self._hook.remove()
        self.checkpointer.close()
