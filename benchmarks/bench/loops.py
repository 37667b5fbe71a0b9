"""hpctrain's training loop against a hand-written PyTorch loop, in one process, interleaved.

Both loops train the same model from the same initial weights on the same in-memory data
in the same order, with the same seed and threads. The hand-written loop is the strictest
fair baseline: it indexes the tensors directly (no DataLoader), then forward, backward,
step, zero_grad. Used by ``hpctrain bench baseline`` and ``benchmarks/overhead.py``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from hpctrain.checkpoint import Checkpointer
from hpctrain.config import Config, load_config, to_dict
from hpctrain.core.env import ClusterEnv
from hpctrain.data.in_memory import MemoryLoader
from hpctrain.models import build_model
from hpctrain.parallel import unwrap
from hpctrain.train import build_components, fit, load_data, seed_everything

CPU = torch.device("cpu")


def make_config(model: str, data: str, batch: int, steps: int, size: int) -> Config:
    return load_config(None, [
        f"model.name={model}", f"data.name={data}", f"data.batch_size={batch}", f"data.synthetic_size={size}",
        f"train.max_steps={steps}", "train.progress=false", "train.eval_each_epoch=false",
        "optim.name=sgd", "optim.lr=0.01", "optim.momentum=0.9", "optim.schedule=constant", "seed=0",
        f"train.log_every={max(1, steps // 5)}",
    ])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the clock stops when the device's work is done, not its queueing


def run_hpctrain(cfg: Config, device: torch.device = CPU) -> tuple[float, torch.nn.Module]:
    """The loop as `hpctrain train` runs it, per-step checkpoint/preemption hook included
    (its default hourly schedule does not fire in a run this short)."""
    env = ClusterEnv()
    parts = build_components(cfg, env, device, load_data(cfg, env, device, with_val=False))
    with tempfile.TemporaryDirectory() as run_dir:
        ckpt = Checkpointer(Path(run_dir), env, device, cfg.checkpoint, parts.checkpoint_state(),
                            run_config=to_dict(cfg))
        seed_everything(cfg.seed)
        start = time.perf_counter()
        fit(cfg, env, device, parts, ckpt=ckpt)
        _sync(device)
        elapsed = time.perf_counter() - start
        ckpt.close()
        ckpt.signals.uninstall()
    return elapsed, unwrap(parts.model)


def run_raw(cfg: Config, device: torch.device = CPU) -> tuple[float, torch.nn.Module]:
    loader = load_data(cfg, ClusterEnv(), device, with_val=False).train_loader
    if not isinstance(loader, MemoryLoader):
        raise ValueError(f"the hand-written loop indexes in-memory data; data.name={cfg.data.name} is not")
    data = loader.dataset
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model.name, data.num_classes, data.input_shape[0]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.seed))  # epoch 0
    inputs, targets, b = data.inputs, data.targets, cfg.data.batch_size
    seed_everything(cfg.seed)
    start = time.perf_counter()
    for step in range(cfg.train.max_steps or 0):
        idx = order[step * b : (step + 1) * b]
        loss = F.cross_entropy(model(inputs[idx].to(device)), targets[idx].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - start, model


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def compare(cfg: Config, repeats: int | Iterable[int],
            device: torch.device = CPU) -> tuple[list[float], list[float], bool]:
    """Interleaved, alternating which loop goes first, so drift and warm-up hit both alike.
    ``repeats``: a count, or the round numbers themselves (e.g. wrapped in a progress bar).
    Returns the raw loop's and hpctrain's seconds per round, and whether every pair of final
    weights was bitwise equal."""
    raw_times, hp_times, equal = [], [], True
    for i in range(repeats) if isinstance(repeats, int) else repeats:
        if i % 2 == 0:
            (t_raw, m_raw), (t_hp, m_hp) = run_raw(cfg, device), run_hpctrain(cfg, device)
        else:
            (t_hp, m_hp), (t_raw, m_raw) = run_hpctrain(cfg, device), run_raw(cfg, device)
        raw_times.append(t_raw)
        hp_times.append(t_hp)
        equal = equal and same_weights(m_raw, m_hp)
    return raw_times, hp_times, equal
