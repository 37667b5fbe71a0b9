"""A complete training loop of your own, from hpctrain's public parts only (``import hpctrain``; 9
names, params_sha256 among them to compare runs): the cluster environment and process group,
a parallel strategy (DDP, ZeRO-1 or sharded: FSDP), a resumable distributed loader over your own
Dataset, exact evaluation, a checkpointer with automatic resume and "preempted: save, then exit 3",
and the step-time meter with its phases named.

    torchrun --standalone --nproc-per-node=2 examples/own_loop.py RUN_DIR [--strategy fsdp]

Run the same command again after a kill or a preemption: it resumes from the newest intact
checkpoint in RUN_DIR, bit for bit. The final line is JSON: the exact accuracy over the whole
validation set (every sample once across ranks), the steps, the weights' sha256 and where
the steps' time went (the meter's breakdown, seconds per step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

import hpctrain

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
    # torchrun's, Slurm's or an already running process group; ended on the way out
    with hpctrain.distributed() as (env, device):
        train_set, val_set = datasets()
        strategy = hpctrain.strategy_for(strategy_name, env, device, seed=0)
        strategy.setup(net, loss_fn=loss_fn, make_optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
                       make_scheduler=lambda optimizer: None)
        loader = hpctrain.MemoryLoader(train_set, env, BATCH, seed=0)  # every sample once per epoch, split by rank
        counters = hpctrain.Counters()
        torch.manual_seed(1 + env.rank)  # dropout differs per rank; a resume restores these streams
        ckpt = hpctrain.Checkpointer(run_dir, env, device,
                                     hpctrain.CheckpointConfig(every_steps=10, every_seconds=None),
                                     {"model": strategy.checkpoint_state(), "scaler": strategy.precision,
                                      "counters": counters, "loader": loader})
        ckpt.resume("auto")
        meter = hpctrain.Meter(BATCH * env.world_size, counters.step, device)
        if not fit(strategy, loader, counters, ckpt, meter, device, pause):
            return ckpt.exit_code  # 3: preempted; the launcher (or Slurm's requeue) runs the same command again
        report(strategy, val_set, meter, counters, env.is_main)
        return 0


def report(strategy: Any, val_set: TensorDataset, meter: hpctrain.Meter, counters: hpctrain.Counters,
           is_main: bool) -> None:
    """The exact validation accuracy (every sample once across ranks), the weights' sha256, the time per phase."""
    result = hpctrain.evaluate_dataset(strategy.model, val_set, 64)  # exact loss and accuracy, on every rank
    # the whole weights (FSDP holds shards: every rank takes part in gathering them), to compare runs
    whole = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True))
    sha256 = hpctrain.params_sha256(strategy.inner, whole)
    if is_main:
        times = {k: v for k, v in meter.summary(counters.step).items() if k.startswith(("time_", "samples_per_s"))}
        print(json.dumps({"accuracy": result.metrics["accuracy"], "count": result.metrics["count"],
                          "steps": counters.step, "params_sha256": sha256, **times}), flush=True)


def fit(strategy: Any, loader: hpctrain.MemoryLoader[Any], counters: hpctrain.Counters, ckpt: hpctrain.Checkpointer,
        meter: hpctrain.Meter, device: torch.device, pause: float) -> bool:
    """The epochs left; False when a preemption signal stopped them (every rank saved the same step)."""
    while counters.epoch < EPOCHS:
        loader.set_epoch(counters.epoch)
        for batch in loader:
            inputs, targets = batch.inputs.to(device), batch.targets.to(device)
            meter.data()  # each mark books the time since the previous one to the phase it names
            strategy.micro_step(inputs, targets, None, sync=True, accum=1)
            meter.compute()
            strategy.optimizer_step()
            meter.optimizer()
            counters.step += 1
            time.sleep(pause)  # --pause: a slower run, to be killed or signalled mid-epoch
            meter.other()
            if ckpt.at_step({}):
                ckpt.close()
                return False
            meter.checkpoint()
        counters.epoch += 1
    ckpt.finish({})
    ckpt.close()
    return True


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "zero1", "fsdp"))
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to sleep after each step")
    args = parser.parse_args()
    sys.exit(main(args.run_dir, args.strategy, args.pause))
