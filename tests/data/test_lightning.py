"""hpctrain's loaders inside a Lightning Trainer (CPU, in-process): 3 epochs, every batch seen each
epoch (Lightning stops after len(loader) batches and calls iter() again), and an exact validation
count."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from hpctrain.data import build_data
from hpctrain.data.config import DataConfig
from hpctrain.env import ClusterEnv

pl = pytest.importorskip("lightning.pytorch")


class _Counting(pl.LightningModule):
    """A tiny classifier that records which samples each training epoch and each validation saw."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(6, 3)
        self.seen: list[Counter[int]] = []
        self.val_counts: list[int] = []

    def on_train_epoch_start(self) -> None:
        self.seen.append(Counter())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen[-1].update(batch.keys.tolist())
        return torch.nn.functional.cross_entropy(self.net(batch.inputs), batch.targets)

    def on_validation_epoch_start(self) -> None:
        self.val_counts.append(0)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_counts[-1] += len(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_lightning_trainer_sees_every_batch_of_every_epoch() -> None:
    data = build_data(DataConfig(name="tests.data.user_datasets:make", batch_size=5), ClusterEnv(),
                      torch.device("cpu"), seed=0)
    module = _Counting()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=data.train_loader, val_dataloaders=data.val_loader)
    assert len(data.train_loader) == 10
    assert [sum(c.values()) for c in module.seen] == [50, 50, 50]  # 10 batches of 5, each epoch
    assert all(set(c) == set(range(50)) and max(c.values()) == 1 for c in module.seen)
    assert module.val_counts == [21, 21, 21]  # every validation sample once, each epoch
