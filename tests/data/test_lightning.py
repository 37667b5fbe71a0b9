"""hpctrain's loaders inside a Lightning Trainer (CPU, in-process): 3 epochs, every batch seen each
epoch (Lightning stops after len(loader) batches and calls iter() again), and an exact validation
count."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from hpctrain.config.data import DataConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.data import build_data

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


class _Signalling(_Counting):
    """Sends this process SIGUSR1 at its 7th training batch, as Slurm's warning would."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 6:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGUSR1)
        return super().training_step(batch, batch_idx)


class _ExitOnPreemption(pl.Callback):
    """docs/cluster.md's Lightning callback, as written there."""

    def __init__(self, path: str) -> None:
        from hpctrain.checkpoint.preempt import Preemption

        self.preemption, self.path = Preemption(["SIGUSR1"]), path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.preemption.agreed(trainer.global_step):
            trainer.save_checkpoint(self.path)  # resume with trainer.fit(..., ckpt_path=path)
            self.preemption.exit()


def test_the_docs_lightning_callback_saves_exits_3_and_the_fit_resumes(tmp_path: Any) -> None:
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    def fit(module: Any, callbacks: list[Any], ckpt_path: str | None = None) -> Any:
        data = build_data(DataConfig(name="tests.data.user_datasets:make", batch_size=5), ClusterEnv(),
                          torch.device("cpu"), seed=0)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             plugins=[SLURMEnvironment(auto_requeue=False)], callbacks=callbacks)
        trainer.fit(module, train_dataloaders=data.train_loader, val_dataloaders=data.val_loader, ckpt_path=ckpt_path)
        return trainer

    path = str(tmp_path / "last.ckpt")
    callback = _ExitOnPreemption(path)
    try:
        with pytest.raises(SystemExit) as ended:
            fit(_Signalling(), [callback])
    finally:
        callback.preemption.flag.uninstall()
    assert ended.value.code == 3
    assert torch.load(path, weights_only=False)["global_step"] == 7  # saved after the signalled step
    resumed = _Counting()
    trainer = fit(resumed, [], ckpt_path=path)
    assert trainer.global_step == 20  # 2 epochs x 10 batches, the first 7 from before the preemption
