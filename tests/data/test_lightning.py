"""hpctrain's loaders inside a Lightning Trainer (CPU, in-process): 3 epochs, every batch seen each
epoch (Lightning stops after len(loader) batches and calls iter() again), and an exact validation
count."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hpctrain.config.data import DataConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.data import build_data


def _lightning() -> tuple[Any, Any]:
    """Lightning and the test modules, imported by the test that needs them, not at collection."""
    pl = pytest.importorskip("lightning.pytorch")
    return pl, pytest.importorskip("tests.data.lightning_modules")


def test_a_lightning_trainer_sees_every_batch_of_every_epoch() -> None:
    pl, lm = _lightning()
    data = build_data(DataConfig(name="tests.data.user_datasets:make", batch_size=5), ClusterEnv(),
                      torch.device("cpu"), seed=0)
    module = lm.Counting()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=data.train_loader, val_dataloaders=data.val_loader)
    assert len(data.train_loader) == 10
    assert [sum(c.values()) for c in module.seen] == [50, 50, 50]  # 10 batches of 5, each epoch
    assert all(set(c) == set(range(50)) and max(c.values()) == 1 for c in module.seen)
    assert module.val_counts == [21, 21, 21]  # every validation sample once, each epoch


def test_the_docs_lightning_callback_saves_exits_3_and_the_fit_resumes(tmp_path: Any) -> None:
    pl, lm = _lightning()
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
    callback = lm.ExitOnPreemption(path)
    try:
        with pytest.raises(SystemExit) as ended:
            fit(lm.Signalling(), [callback])
    finally:
        callback.preemption.flag.uninstall()
    assert ended.value.code == 3
    assert torch.load(path, weights_only=False)["global_step"] == 7  # saved after the signalled step
    resumed = lm.Counting()
    trainer = fit(resumed, [], ckpt_path=path)
    assert trainer.global_step == 20  # 2 epochs x 10 batches, the first 7 from before the preemption
