"""A complete training loop of your own, from hpctrain's public parts only: the cluster
environment, a parallel strategy, a resumable distributed loader over your own Dataset,
precision, exact evaluation, a checkpointer with automatic resume and "preempted: save, then
exit 3", and the step-time meter.

    torchrun --standalone --nproc-per-node=2 examples/own_loop.py RUN_DIR [--strategy zero1]

Run the same command again after a kill or a preemption: it resumes from the newest intact
checkpoint in RUN_DIR, bit for bit. The final line is JSON: the exact accuracy over the whole
validation set (every sample once across ranks), the steps, and the weights' sha256.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import hpctrain
from hpctrain.checkpoint import EXIT_PREEMPTED, Checkpointer
from hpctrain.checkpoint.state import Counters
from hpctrain.config.checkpoint import CheckpointConfig
from hpctrain.config.parallel import ParallelConfig
from hpctrain.data.memory import EvalLoader, MemoryLoader
from hpctrain.evaluation.metrics import Accuracy, MeanLoss
from hpctrain.parallel import strategy_for
from hpctrain.rundir import params_sha256
from hpctrain.telemetry.meter import Meter

EPOCHS, BATCH = 3, 16


def datasets() -> tuple[TensorDataset, TensorDataset]:
    """Your own data: any map-style Dataset of (input, target). Two separable blobs here."""
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 2, (700,), generator=gen)
    inputs = torch.randn(700, 16, generator=gen) + targets[:, None].float() * 1.5
    return TensorDataset(inputs[:512], targets[:512]), TensorDataset(inputs[512:], targets[512:])


def net() -> nn.Module:
    """Your own model (dropout: the random streams are part of what a resume restores)."""
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 2))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


def main(run_dir: Path, strategy_name: str, pause: float = 0.0) -> int:
    env = hpctrain.detect()  # torchrun's, Slurm's, or an already running process group
    device = hpctrain.init_distributed(env)
    try:
        return train(run_dir, strategy_name, env, device, pause)
    finally:
        hpctrain.teardown()


def train(run_dir: Path, strategy_name: str, env: hpctrain.ClusterEnv, device: torch.device, pause: float) -> int:
    train_set, val_set = datasets()
    strategy = strategy_for(ParallelConfig(strategy=strategy_name), env, device, seed=0)
    strategy.setup(net, loss_fn=loss_fn, make_optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
                   make_scheduler=lambda optimizer: None)
    loader = MemoryLoader(train_set, env, BATCH, seed=0)  # every sample once per epoch, split by rank
    counters = Counters()
    torch.manual_seed(1 + env.rank)  # dropout differs per rank; a resume restores these streams
    ckpt = Checkpointer(run_dir, env, device, CheckpointConfig(every_steps=10, every_seconds=None),
                        {"model": strategy.checkpoint_state(), "scaler": strategy.precision,
                         "counters": counters, "loader": loader})
    ckpt.resume("auto")
    meter = Meter(BATCH * env.world_size, counters.step, device)
    while counters.epoch < EPOCHS:
        loader.set_epoch(counters.epoch)
        for batch in loader:
            strategy.micro_step(batch.inputs.to(device), batch.targets.to(device), None, sync=True, accum=1)
            strategy.optimizer_step()
            counters.step += 1
            time.sleep(pause)  # --pause: a slower run, to be killed or signalled mid-epoch
            meter.lap(0)
            if ckpt.at_step({}):  # a preemption signal: every rank saved the same step
                ckpt.close()
                return EXIT_PREEMPTED  # the launcher (or Slurm's requeue) runs the same command again
        counters.epoch += 1
    ckpt.finish({})
    ckpt.close()
    result = hpctrain.evaluate(strategy.model, EvalLoader(val_set, env, 64), [MeanLoss(), Accuracy()], env, device,
                               strategy.precision)
    if env.is_main:
        print(json.dumps({"accuracy": result.metrics["accuracy"], "count": result.metrics["count"],
                          "steps": counters.step, "samples_per_s": meter.summary(counters.step).get("samples_per_s"),
                          "params_sha256": params_sha256(strategy.inner)}), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "zero1"))
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to sleep after each step")
    args = parser.parse_args()
    sys.exit(main(args.run_dir, args.strategy, args.pause))
