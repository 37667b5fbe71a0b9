"""What ``parallel.strategy=auto`` knows of a model without a declared shape (the CNNs, users'
models from ``model.input_shape``; the built-in transformers are their shape alone,
:mod:`hpctrain.planning.profile`): it is built on the meta device (no memory, no compute) and
measured once, per piece a plan can place on a rank: the parameters of the
part before the transformer blocks (embeddings), of each block (and the share tensor
parallelism splits) and of the part after them (final norm, head); the bytes autograd saves
for backward in each piece under every activation-checkpointing mode; and the FLOPs of one
sample's forward and backward (``torch.utils.flop_counter``).

Everything is counted by :mod:`hpctrain.telemetry.measure` (the estimator's and telemetry's
rules: each storage once, parameters left out, floating tensors at the compute precision's
element size), with two additions a plan needs: the loss (cross-entropy keeps fp32
log-probabilities, counted at their own size) and, under ``selective`` checkpointing, the matmul
outputs its policy keeps, which a checkpoint stores out of the saved-tensor hooks' sight. The
meta count errs high where a kernel on real memory saves less than its meta decomposition
(about 25% on the gpt at its default size, against a CPU forward, measured).
"""

from __future__ import annotations

import contextlib
import difflib
import math
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.core.section import ConfigError
from hpctrain.estimate.gpu_memory import compute_bytes
from hpctrain.models import REGISTRY, build_model
from hpctrain.models.family import family_of
from hpctrain.models.shape import TransformerShape
from hpctrain.models.user import CAUSAL_LM
from hpctrain.parallel.checkpointing import _SAVE, apply_activation_checkpointing
from hpctrain.planning.profile import Profile, Saved
from hpctrain.telemetry import measure

if TYPE_CHECKING:
    from hpctrain.config import Config

MODES = ("none", "selective", "block")  # parallel.activation_checkpointing
SAMPLES = 2  # measured at two samples (a batch norm needs more than one), reported per sample


def profile(cfg: Config) -> Profile:
    """Build ``cfg.model`` on the meta device and measure it; ConfigError for a model whose input is unknown."""
    sample, dtype, classes = _input(cfg)
    tokens = dtype == torch.long

    def factory() -> nn.Module:
        return build_model(cfg.model.name, classes, config=cfg.model, task=CAUSAL_LM if tokens else None)

    x = torch.zeros((SAMPLES, *sample), dtype=dtype, device="meta")
    element = compute_bytes(cfg.precision)
    saved = {mode: _saved(_checkpointed(measure.on_meta(factory), mode), x, element, tokens, mode) for mode in MODES}
    model = measure.on_meta(factory)
    first, blocks, last = _pieces(model)
    split = _tp_split(model, blocks)
    flops, block_flops = _flops(model, x, len(blocks))
    shared = _numel(first) + _numel(last) - _numel(first + last)
    return Profile(cfg.model.name, _numel(first), tuple(_numel([b]) for b in blocks), split, _numel(last), shared,
                   next(model.parameters()).element_size(), saved, flops, block_flops,
                   sum(1 for m in model.modules() if not any(True for _ in m.children())),
                   _shape(model, cfg) if blocks else None, sample[0] if tokens else None)


def sample_elements(cfg: Config) -> int:
    """Values in one sample's input (28 x 28 for MNIST): what bounds a measured model's global batch,
    known before the model is built; ConfigError as :func:`profile` for a model without an input."""
    return math.prod(_input(cfg)[0])


def _input(cfg: Config) -> tuple[tuple[int, ...], torch.dtype, int]:
    """One sample's shape and dtype and the class count: a registered model's own; a user's from
    ``model.input_shape`` (token ids of that length under ``train.task=causal_lm``, else a float
    tensor); ConfigError when a user's model gives none."""
    spec = REGISTRY.get(cfg.model.name)
    given = getattr(cfg.model, "input_shape", None)
    if spec is not None:
        tokens = spec.input_dtype == torch.long
        return ((cfg.model.seq_len,) if tokens else spec.input_shape), spec.input_dtype, \
            cfg.model.num_classes or spec.num_classes
    if ":" not in cfg.model.name:  # neither registered nor package.module:NAME: a typo, not a user's model
        near = difflib.get_close_matches(cfg.model.name, REGISTRY, n=1)
        raise ConfigError(f"model.name={cfg.model.name!r} is not a registered model; choose one of: "
                          f"{', '.join(REGISTRY)}, or give a factory or nn.Module class as package.module:NAME"
                          + (f"; hint: model.name={near[0]}" if near else ""))
    if not given:
        raise ConfigError(f"parallel.strategy=auto sizes a user's model from one sample's shape; model.name="
                          f"{cfg.model.name} declares no input shape to measure it with; hint: "
                          "model.input_shape=[3,224,224] (an image) or [SEQ_LEN] (token ids), or choose "
                          "parallel.strategy yourself")
    shape = tuple(int(d) for d in given)
    tokens = cfg.train.task == CAUSAL_LM and len(shape) == 1
    return shape, (torch.long if tokens else torch.float32), cfg.model.num_classes or cfg.model.vocab or 10


def _pieces(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module], list[nn.Module]]:
    """(children before ``blocks``, the blocks, children after): where a pipeline puts them."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        return [model], [], []
    names = [name for name, _ in model.named_children()]
    at = names.index("blocks")
    children = list(model.children())
    return children[:at], list(blocks), children[at + 1:]


def _tp_split(model: nn.Module, blocks: list[nn.Module]) -> tuple[int, ...]:
    """Of each block's elements, those tensor parallelism splits: the Linears its model family's
    tensor plan makes colwise or rowwise (none without a plan)."""
    plan = family_of(model).tensor_plan_of(model)
    if plan is None:
        return tuple(0 for _ in blocks)
    return tuple(sum(_numel([m]) for name, m in block.named_modules()
                     if isinstance(m, nn.Linear) and plan.style(name, m) in ("colwise", "rowwise"))
                 for block in blocks)


_numel = measure.param_count  # a weight tied between two pieces once


def _checkpointed(model: nn.Module, mode: str) -> nn.Module:
    return apply_activation_checkpointing(model, mode=mode)


def _shape(model: nn.Module, cfg: Config) -> TransformerShape | None:
    """The estimator's description of the model: its own (``shape.transformer()``), or its family's."""
    own = getattr(getattr(model, "shape", None), "transformer", None)
    if callable(own):
        shape = own()
        return shape if isinstance(shape, TransformerShape) else None
    family = family_of(model)
    return family.shape(cfg.model) if family.shape is not None else None


class _Where:
    """Which piece the forward is in: set by hooks on the blocks (``None``: before or after them)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.block: int | None = None
        self.after = False
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda *_, i=i: self._enter(i))
            block.register_forward_hook(lambda *_: self._leave())

    def _enter(self, i: int) -> None:
        self.block = i

    def _leave(self) -> None:
        self.block, self.after = None, True


class _Tally:
    def __init__(self, blocks: int) -> None:
        self.first = self.last = 0.0
        self.blocks = [0.0] * blocks

    def add(self, where: _Where, nbytes: float) -> None:
        if where.block is not None:
            self.blocks[where.block] += nbytes
        elif where.after:
            self.last += nbytes
        else:
            self.first += nbytes

    def per_sample(self) -> Saved:
        return Saved(self.first / SAMPLES, tuple(b / SAMPLES for b in self.blocks), self.last / SAMPLES)


class _PolicySaved(TorchDispatchMode):
    """Outputs of the ops selective checkpointing keeps, inside a block."""

    def __init__(self, where: _Where, tally: _Tally, element: int) -> None:
        super().__init__()
        self.where, self.tally, self.element, self.keep = where, tally, element, _SAVE

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in self.keep and self.where.block is not None:
            first = out[0] if isinstance(out, tuple) else out
            self.tally.add(self.where, measure.storage_bytes(first, self.element))
        return out


def _saved(model: nn.Module, x: torch.Tensor, element: int, tokens: bool, mode: str) -> Saved:
    """One meta forward and loss of ``model`` under the saved-tensor meter, tallied by piece."""
    _, blocks, _ = _pieces(model)
    where, tally = _Where(blocks), _Tally(len(blocks))
    meter = measure.SavedTensorMeter(measure.parameter_storages(model), element_bytes=element,
                                     on_new=lambda nbytes: tally.add(where, nbytes))
    policy = _PolicySaved(where, tally, element) if mode == "selective" else contextlib.nullcontext()
    with meter, policy:
        out = model(x)
        meter.element_bytes = None  # the loss's fp32 log-probabilities stay fp32 under autocast
        logits = out.flatten(0, 1) if tokens else out.flatten(1)
        F.cross_entropy(logits.float(), torch.zeros(logits.shape[0], dtype=torch.long, device="meta"))
    return tally.per_sample()


def _flops(model: nn.Module, x: torch.Tensor, blocks: int) -> tuple[float, float]:
    """Forward+backward FLOPs per sample: the whole model's and its blocks' (the counter's per-module totals)."""
    counted = measure.train_flops(model, x)
    inside = sum(n for name, n in counted.by_module.items() if re.fullmatch(r"[^.]+\.blocks\.\d+", name))
    return counted.total / SAMPLES, float(inside) / SAMPLES if blocks else 0.0
