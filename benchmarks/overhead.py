"""hpctrain's training loop against a hand-written PyTorch loop, interleaved in one run.

Both loops train the same model from the same initial weights on the same in-memory data
in the same order, with the same seed and threads. The hand-written loop is the strictest
fair baseline: it indexes the tensors directly (no DataLoader), then forward, backward,
step, zero_grad. Reported: the median time ratio (hpctrain / raw) for simple_cnn on
CIFAR-shaped synthetic data, whether the final weights are bitwise equal, and the
per-step overhead in microseconds for a tiny model where the loop itself dominates, and the
non-finite watch's own cost per step (train.nonfinite) on the gradients of nanoGPT's baby GPT:
with clipping it reads the clip's norm (no pass of its own), without one fused L2 pass, beside
the largest-magnitude pass it made before issue 43.

    python benchmarks/overhead.py --json bench-out/overhead.json

(from the repository root, with hpctrain installed or ``PYTHONPATH=.``; nothing from tests/.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

# the two loops and their comparison are shared with `hpctrain bench baseline`
from bench.loops import compare, make_config


def tiny_linear(num_classes: int = 10) -> torch.nn.Module:
    """One Linear 128 -> classes: a model so small that the loop itself dominates a step.
    Given to the trainer as ``model.name=<this module>:tiny_linear`` (no import of tests/)."""
    return torch.nn.Linear(128, num_classes)


def watch_cost(steps: int) -> dict[str, float]:
    """Microseconds per step of the watch's gradient judgement, each way (median of 5 timings)."""
    from hpctrain.models.gpt import GPT, GPTShape
    from hpctrain.parallel.clip import local_grad_norm
    from hpctrain.precision import local_max_abs

    torch.manual_seed(0)
    model = GPT(GPTShape(vocab=256, seq_len=64, n_layers=4, hidden=128, heads=4, bias=False))
    tokens = torch.randint(0, 256, (12, 64))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    params = list(model.parameters())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])  # the clip's
    ways = {"watch_clip_us": lambda: torch.stack([loss.detach(), norm]).tolist(),
            "watch_no_clip_us": lambda: torch.stack([loss.detach(), local_grad_norm(params)]).tolist(),
            "watch_max_abs_before_us": lambda: torch.stack(
                [loss.detach(), local_max_abs(p.grad for p in params if p.grad is not None)]).tolist()}
    out = {}
    for name, way in ways.items():
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(steps):
                way()
            times.append((time.perf_counter() - start) / steps * 1e6)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--cnn-steps", type=int, default=10)
    parser.add_argument("--tiny-steps", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--watch-steps", type=int, default=200)
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
    result |= watch_cost(args.watch_steps)
    print(f"non-finite watch, baby GPT's gradients: {result['watch_clip_us']:.0f} us/step with clipping (the clip's "
          f"norm), {result['watch_no_clip_us']:.0f} us/step without (one fused L2 pass); the max |g| pass it made "
          f"before: {result['watch_max_abs_before_us']:.0f} us/step")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
