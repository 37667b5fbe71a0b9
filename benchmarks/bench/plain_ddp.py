"""The reference of ``hpctrain bench scaling``: a plain, hand-written PyTorch DDP loop.

    torchrun --standalone --nproc-per-node=N -m bench.plain_ddp --out PREFIX --batch 64 ...

What the PyTorch DDP tutorial writes, and nothing of hpctrain's machinery: the environment
variables torchrun sets, ``init_process_group``, ``DistributedSampler`` + ``DataLoader`` over
a ``TensorDataset``, ``DistributedDataParallel`` with its defaults, SGD. It trains the same
model class as ``model.name=simple_cnn``, on CIFAR-shaped random data of the same size, with
the same per-rank batch, optimizer settings and thread count as the hpctrain runs it is
compared with. One rank trains without DDP, as a single-process script would.

Timing: ``warmup`` steps, then the clock runs over ``steps`` steps; both ends read the loss
back to the host (a device sync), as hpctrain's metrics rows do.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from bench.child import finish, report
from hpctrain.models.simple_cnn import SimpleCNN


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.plain_ddp", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="prefix of the per-rank reports PREFIX.rankN.json")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--warmup", type=int, default=5, help="steps before the clock starts")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--size", type=int, default=20000, help="training samples (all ranks together)")
    return p.parse_args(argv)


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> float:
    """Samples per second over all ranks, in the timed steps."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(args.size, 3, 32, 32, generator=gen)
    data = TensorDataset(images, torch.randint(0, 10, (args.size,), generator=gen))
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0,
                                                          drop_last=True)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True,
                        pin_memory=device.type == "cuda")
    torch.manual_seed(0)
    model: torch.nn.Module = SimpleCNN().to(device)
    if world > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    start, loss = 0.0, torch.zeros(())
    for step, (inputs, targets) in enumerate(itertools.islice(loader, args.warmup + args.steps)):
        if step == args.warmup:
            float(loss.detach())  # the warm-up's work is done before the clock starts
            start = time.perf_counter()
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        loss = F.cross_entropy(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    float(loss.detach())
    return args.steps * args.batch * world / (time.perf_counter() - start)


def main(argv: list[str]) -> int:
    args = parse(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if args.size < (args.warmup + args.steps) * args.batch * world:
        raise SystemExit(f"--size {args.size} is smaller than (warmup + steps) x batch x ranks")
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        rate = train(args, rank, world, device)
    finally:
        if world > 1:
            dist.destroy_process_group()
    report(Path(args.out), rank, {"samples_per_s": rate})
    return 0


if __name__ == "__main__":
    finish(main(sys.argv[1:]))
