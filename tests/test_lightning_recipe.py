"""docs/cluster.md's Lightning recipe, as written there, under ``hpctrain run -n 2`` (issue 24).

``plugins=[SLURMEnvironment(auto_requeue=False)]`` reads the world from Slurm's variables:
on a laptop there were none (``KeyError: 'SLURM_NODEID'``), and in the step ``hpctrain slurm``
writes (one srun task per node, torchrun's ranks below it) ``SLURM_NTASKS`` was the number of
nodes. ``hpctrain run`` now gives every rank Slurm's variables as srun would have set them for
its ranks. Each case: a 2-rank DDP fit with the recipe's callback, SIGUSR1 to the launcher,
``last.ckpt`` saved, every rank and the launcher exit 3.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.core.errors import EXIT_PREEMPTED
from hpctrain.launch.rank import slurm_view
from tests.dist_utils import finish_launch, launch_env
from tests.launch.test_signal_exit import wait_for

# Only the recipe's ranks import Lightning (~7 s of CPU): looked up, not imported, so that no pytest
# worker pays for it while collecting, and the unit test below runs without the extra.
needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="the recipe needs Lightning (the test extra)")

# The recipe (the callback and the plugin, as docs/cluster.md writes them) in a small fit.
RECIPE = '''
import os
import time
from pathlib import Path

import lightning
import torch
from lightning.pytorch.plugins.environments import SLURMEnvironment

from hpctrain.checkpoint.preempt import Preemption


class ExitOnPreemption(lightning.Callback):
    def __init__(self):
        self.preemption = Preemption()
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.preemption.agreed(trainer.global_step):
            trainer.save_checkpoint("last.ckpt")   # resume with trainer.fit(..., ckpt_path="last.ckpt")
            self.preemption.exit()


class Tiny(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            print(f"rank {self.global_rank} of {self.trainer.world_size}", flush=True)
            Path(f"fitting-{self.global_rank}").touch()
        time.sleep(0.02)
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


data = torch.utils.data.TensorDataset(torch.randn(4096, 4))
trainer = lightning.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp", max_epochs=1,
                            plugins=[SLURMEnvironment(auto_requeue=False)], callbacks=[ExitOnPreemption()],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
print("finished without a preemption", flush=True)
'''

# What srun sets in the step `hpctrain slurm` writes: one task per node, which runs `hpctrain run`.
SRUN_STEP = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "recipe", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1",
             "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
             "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost"}


def test_slurms_variables_follow_torchruns_world() -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "GROUP_RANK": "2",
                "LOCAL_WORLD_SIZE": "2"}
    assert slurm_view(torchrun) == {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
                                    "SLURM_NODEID": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "4"}
    assert slurm_view({**torchrun, **SRUN_STEP, "SLURM_NNODES": "4"})["SLURM_NTASKS"] == "8"  # srun's 1 replaced
    assert slurm_view({"RANK": "0", "WORLD_SIZE": "1"}) == {}  # not under torchrun: nothing to describe


@needs_lightning
@pytest.mark.slow
@pytest.mark.parametrize("where", ["laptop", "srun step"])
def test_the_lightning_recipe_runs_as_written_under_hpctrain_run(tmp_path: Path, where: str) -> None:
    (tmp_path / "recipe.py").write_text(RECIPE)
    extra = SRUN_STEP if where == "srun step" else {}
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "run", "-n", "2", "--hang-timeout=0", "recipe.py"],
                            cwd=tmp_path, env=launch_env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    for rank in (0, 1):
        wait_for(tmp_path / f"fitting-{rank}", proc, timeout=300)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out = finish_launch(proc, timeout=300)
    assert "KeyError" not in out and "rank 0 of 2" in out and "rank 1 of 2" in out, out[-4000:]
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert (tmp_path / "last.ckpt").is_file() and "finished without a preemption" not in out
