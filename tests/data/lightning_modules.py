"""Lightning modules and a callback for tests/data/test_lightning.py, in a module of their own so
that only the xdist worker running those tests imports Lightning (about 8 CPU-s per import)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch


class Counting(pl.LightningModule):
    """A tiny classifier that records which samples each training epoch and each validation saw."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(6, 3)
        self.seen: list[Counter[int]] = []
        self.val_counts: list[int] = []

    def on_train_epoch_start(self) -> None:
        self.seen.append(Counter())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self.seen:  # a fit resumed mid-epoch starts without on_train_epoch_start
            self.seen.append(Counter())
        self.seen[-1].update(batch.keys.tolist())
        return torch.nn.functional.cross_entropy(self.net(batch.inputs), batch.targets)

    def on_validation_epoch_start(self) -> None:
        self.val_counts.append(0)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_counts[-1] += len(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Signalling(Counting):
    """Sends this process SIGUSR1 at its 7th training batch, as Slurm's warning would."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 6:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGUSR1)
        return super().training_step(batch, batch_idx)


class ExitOnPreemption(pl.Callback):
    """docs/cluster.md's Lightning callback, as written there."""

    def __init__(self, path: str) -> None:
        from hpctrain.checkpoint.preempt import Preemption

        self.preemption, self.path = Preemption(["SIGUSR1"]), path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.preemption.agreed(trainer.global_step):
            trainer.save_checkpoint(self.path)  # resume with trainer.fit(..., ckpt_path=path)
            self.preemption.exit()
