"""hpctrain's training loop against a hand-written PyTorch loop, interleaved in one run.

Both loops train the same model from the same initial weights on the same in-memory data
in the same order, with the same seed and threads. The hand-written loop is the strictest
fair baseline: it indexes the tensors directly (no DataLoader), then forward, backward,
step, zero_grad. Reported: the median time ratio (hpctrain / raw) for simple_cnn on
CIFAR-shaped synthetic data, whether the final weights are bitwise equal, and the
per-step overhead in microseconds for a tiny model where the loop itself dominates.

    python benchmarks/overhead.py --json bench-out/overhead.json

(from the repository root, with hpctrain installed or ``PYTHONPATH=.``; nothing from tests/.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hpctrain.checkpoint import Checkpointer
from hpctrain.config import Config, load_config
from hpctrain.data import build_data
from hpctrain.env import ClusterEnv
from hpctrain.models import build_model
from hpctrain.parallel import unwrap
from hpctrain.train import build_components, fit, seed_everything

CPU = torch.device("cpu")


def tiny_linear(num_classes: int = 10) -> torch.nn.Module:
    """One Linear 128 -> classes: a model so small that the loop itself dominates a step.
    Given to the trainer as ``model.name=<this module>:tiny_linear`` (no import of tests/)."""
    return torch.nn.Linear(128, num_classes)


def make_config(model: str, data: str, batch: int, steps: int, size: int) -> Config:
    return load_config(None, [
        f"model.name={model}", f"data.name={data}", f"data.batch_size={batch}", f"data.synthetic_size={size}",
        f"train.max_steps={steps}", "train.progress=false", "train.eval_each_epoch=false",
        "optim.name=sgd", "optim.lr=0.01", "optim.momentum=0.9", "optim.schedule=constant", "seed=0",
        f"train.log_every={max(1, steps // 5)}",
    ])


def run_hpctrain(cfg: Config) -> tuple[float, torch.nn.Module]:
    """The loop as `hpctrain train` runs it, per-step checkpoint/preemption hook included
    (its default hourly schedule does not fire in a run this short)."""
    env = ClusterEnv()
    parts = build_components(cfg, env, CPU, build_data(cfg, env, CPU, with_val=False))
    with tempfile.TemporaryDirectory() as run_dir:
        ckpt = Checkpointer(cfg, env, CPU, Path(run_dir), parts)
        seed_everything(cfg.seed)
        start = time.perf_counter()
        fit(cfg, env, CPU, parts, ckpt=ckpt)
        elapsed = time.perf_counter() - start
        ckpt.close()
        ckpt.signals.uninstall()
    return elapsed, unwrap(parts.model)


def run_raw(cfg: Config) -> tuple[float, torch.nn.Module]:
    data = build_data(cfg, ClusterEnv(), CPU, with_val=False).train_loader.dataset
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model.name, data.num_classes, data.input_shape[0])
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.seed))  # epoch 0
    inputs, targets, b = data.inputs, data.targets, cfg.data.batch_size
    seed_everything(cfg.seed)
    start = time.perf_counter()
    for step in range(cfg.train.max_steps or 0):
        idx = order[step * b : (step + 1) * b]
        loss = F.cross_entropy(model(inputs[idx]), targets[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, model


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def compare(cfg: Config, repeats: int) -> tuple[list[float], list[float], bool]:
    """Interleaved, alternating which loop goes first, so drift and warm-up hit both alike."""
    raw_times, hp_times, equal = [], [], True
    for i in range(repeats):
        if i % 2 == 0:
            (t_raw, m_raw), (t_hp, m_hp) = run_raw(cfg), run_hpctrain(cfg)
        else:
            (t_hp, m_hp), (t_raw, m_raw) = run_hpctrain(cfg), run_raw(cfg)
        raw_times.append(t_raw)
        hp_times.append(t_hp)
        equal = equal and same_weights(m_raw, m_hp)
    return raw_times, hp_times, equal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--cnn-steps", type=int, default=10)
    parser.add_argument("--tiny-steps", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cnn = make_config("simple_cnn", "synthetic_cifar", 128, args.cnn_steps, 128 * args.cnn_steps)
    cnn_raw, cnn_hp, cnn_equal = compare(cnn, args.repeats)
    tiny = make_config(f"{__name__}:tiny_linear", "synthetic_tiny", 32, args.tiny_steps, 32 * args.tiny_steps)
    tiny_raw, tiny_hp, tiny_equal = compare(tiny, args.repeats)

    ratio = statistics.median(h / r for h, r in zip(cnn_hp, cnn_raw))
    overhead_us = statistics.median((h - r) / args.tiny_steps * 1e6 for h, r in zip(tiny_hp, tiny_raw))
    raw_step_us = statistics.median(tiny_raw) / args.tiny_steps * 1e6
    print(f"simple_cnn b128 fp32, {args.cnn_steps} steps x {args.repeats}: raw {statistics.median(cnn_raw):.3f} s, "
          f"hpctrain {statistics.median(cnn_hp):.3f} s, ratio {ratio:.4f}, weights equal: {cnn_equal}")
    print(f"tiny Linear(128,10) b32, {args.tiny_steps} steps: raw {raw_step_us:.1f} us/step, "
          f"hpctrain overhead {overhead_us:+.1f} us/step, weights equal: {tiny_equal}")
    result = {"cnn_time_ratio": ratio, "weights_equal": cnn_equal and tiny_equal,
              "tiny_overhead_us_per_step": overhead_us, "tiny_raw_us_per_step": raw_step_us,
              "threads": args.threads, "repeats": args.repeats}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
