"""DeepSpeed ZeRO stage 1-3 from hpctrain's config (the ``deepspeed`` extra).

DeepSpeed owns the optimizer step, the gradient reduction and (stage 3) the parameter
gathering, so the loop calls :class:`DeepSpeedStep` (``step(inputs, targets) -> loss``):
forward, ``engine.backward`` (which divides by the accumulation steps itself) and
``engine.step`` (which steps the optimizer only at an accumulation boundary).

On a machine without CUDA it runs on CPU with gloo (``DS_ACCELERATOR=cpu``). Its first use
JIT-builds C++ ops with ninja; ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/hpctrain/torch_extensions``) keeps them for the next run.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from hpctrain.env import ClusterEnv
from hpctrain.errors import UserError

INSTALL_HINT = ("pip install -c <(echo torch==$(python -c 'import torch; print(torch.__version__)')) "
                "'hpctrain[deepspeed]'  (the constraint keeps pip from replacing your torch)")
EXTENSIONS_CACHE = Path("~/.cache/hpctrain/torch_extensions").expanduser()


class DeepSpeedMissing(UserError):
    """strategy=deepspeed without DeepSpeed installed."""


def import_deepspeed() -> ModuleType:
    """DeepSpeed, set up for this machine (CPU accelerator without CUDA, a shared op cache)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_CACHE))
    try:
        return importlib.import_module("deepspeed")
    except ImportError as err:
        raise DeepSpeedMissing(f"parallel.strategy=deepspeed needs DeepSpeed, which is not importable ({err}); "
                               f"hint: {INSTALL_HINT}") from None


def ds_config(*, stage: int, micro_batch: int, grad_accum: int = 1, clip_grad_norm: float = 0.0,
              precision: str = "fp32") -> dict[str, Any]:
    """The DeepSpeed config dict for hpctrain's settings (one place to read what is mapped)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip_grad_norm,
        "steps_per_print": 2**31 - 1,  # hpctrain logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return config


def init_deepspeed(model: nn.Module, optimizer: torch.optim.Optimizer, *, env: ClusterEnv, stage: int,
                   micro_batch: int, grad_accum: int = 1, clip_grad_norm: float = 0.0, precision: str = "fp32") -> Any:
    """The DeepSpeed engine around ``model`` and a (fresh) torch ``optimizer`` over its parameters.
    Call after hpctrain started the process group: DeepSpeed reuses it."""
    deepspeed = import_deepspeed()
    # DeepSpeed reads its rank from the environment, as its own launcher sets it; hpctrain's
    # ClusterEnv may come from Slurm variables or a test harness instead.
    for name, value in (("LOCAL_RANK", env.local_rank), ("RANK", env.rank), ("WORLD_SIZE", env.world_size)):
        os.environ.setdefault(name, str(value))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)
    config = ds_config(stage=stage, micro_batch=micro_batch, grad_accum=grad_accum,
                       clip_grad_norm=clip_grad_norm, precision=precision)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


class DeepSpeedStep:
    """``step(inputs, targets) -> loss``: one micro-batch through the engine (forward,
    backward, and the optimizer step when it closes an accumulation window)."""

    def __init__(self, engine: Any, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.engine, self.loss_fn = engine, loss_fn

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(self.engine(inputs), targets)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

