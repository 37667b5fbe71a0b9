"""What the usual distributed-validation recipe reports, next to hpctrain and the truth.

Run under torchrun (3 ranks in docs/evaluation.md) with weights from any run:

    hpctrain train data.max_train_samples=5000 run.dir=runs/eval-demo
    torchrun --standalone --nproc-per-node=3 benchmarks/eval_recipes.py --weights runs/eval-demo/model.pt

Rows: (1) the tutorial recipe: DistributedSampler on the test set, rank 0 prints its own
shard's accuracy; (2) the same sampler with counts all-reduced (padding repeats counted
twice); (3) hpctrain.evaluation.evaluate; (4) one process over the whole set (the truth).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hpctrain.core import env as cluster
from hpctrain.data.in_memory import EvalLoader
from hpctrain.data.sources import load_dataset
from hpctrain.evaluation.evaluate import evaluate
from hpctrain.evaluation.job import load_weights
from hpctrain.models import build_model
from hpctrain.tasks.metrics import Accuracy


@torch.no_grad()
def sampler_counts(model: torch.nn.Module, data, env: cluster.ClusterEnv) -> tuple[int, int]:
    """(correct, count) of this rank's DistributedSampler shard: padded with repeats."""
    plain = TensorDataset(data.inputs, data.targets)  # what the tutorial scripts use
    sampler = DistributedSampler(plain, num_replicas=env.world_size, rank=env.rank, shuffle=False)
    correct = count = 0
    for x, y in DataLoader(plain, batch_size=256, sampler=sampler):
        correct += int((model(x).argmax(1) == y).sum())
        count += len(y)
    return correct, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--split", default="test")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    env = cluster.detect()
    device = cluster.init_distributed(env)
    data = load_dataset("mnist", args.split)
    model = build_model("mnist_cnn")
    load_weights(model, args.weights)
    model.eval()

    correct, count = sampler_counts(model, data, env)
    local = torch.tensor([correct, count])
    if env.distributed:
        dist.all_reduce(local)
    exact = evaluate(model, EvalLoader(data, env, 256), [Accuracy()], env, device).metrics
    if env.is_main:
        truth = evaluate(model, EvalLoader(data, cluster.ClusterEnv(), 256), [Accuracy()], cluster.ClusterEnv(),
                         device).metrics
        rows = [
            ("DistributedSampler, rank 0 prints its shard", correct, count),
            ("DistributedSampler, counts all-reduced", int(local[0]), int(local[1])),
            (f"hpctrain.evaluation.evaluate ({env.world_size} ranks)", exact["correct"], exact["count"]),
            ("single process (truth)", truth["correct"], truth["count"]),
        ]
        print(f"MNIST {args.split} set ({len(data)} samples), {env.world_size} ranks\n")
        print("| recipe | correct | count | accuracy |\n|---|---|---|---|")
        for name, c, n in rows:
            print(f"| {name} | {c} | {n} | {c / n:.4f} |")
        if args.json:
            args.json.write_text(json.dumps([dict(recipe=r, correct=c, count=n) for r, c, n in rows], indent=2))
    cluster.teardown()


if __name__ == "__main__":
    main()
