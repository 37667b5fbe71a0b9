"""The model registry: built-in names and their input shapes, and :func:`build_model` for a
registered name or a user's ``package.module:NAME``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hpctrain.config.model import ModelConfig
from hpctrain.core.section import ConfigError
from hpctrain.models.family import mark_family
from hpctrain.models.gpt import GPT, build_gpt
from hpctrain.models.llama import build_llama
from hpctrain.models.mnist_net import MnistCNN
from hpctrain.models.outputs import pass_labels
from hpctrain.models.resnet import ResNet18
from hpctrain.models.simple_cnn import SimpleCNN
from hpctrain.models.user import (
    CAUSAL_LM,
    ModelError,
    build_user_model,
    check_model_output,
    factory_kwargs,
    load_factory,
    output_width,
)

__all__ = ["GPT", "REGISTRY", "ModelError", "ModelSpec", "build_model", "check_model_output", "count_parameters"]


@dataclass(frozen=True)
class ModelSpec:
    factory: Callable[..., nn.Module]
    input_shape: tuple[int, ...]
    description: str
    # torch.long: a token model, (batch, seq) ids -> (batch, seq, vocab) logits, sized by the model config
    input_dtype: torch.dtype = torch.float32
    num_classes: int = 10  # the output size when neither the data nor the config gives one


REGISTRY: dict[str, ModelSpec] = {
    "mnist_cnn": ModelSpec(MnistCNN, (1, 28, 28), "SCA2025 tutorial MNIST network"),
    "simple_cnn": ModelSpec(SimpleCNN, (3, 32, 32), "workshop baseline CNN for 3x32x32"),
    "resnet18": ModelSpec(ResNet18, (3, 32, 32), "ResNet-18, CIFAR variant"),
    "gpt": ModelSpec(build_gpt, (128,), "decoder-only transformer (model.n_layers/hidden/heads/seq_len)",
                     torch.long, 256),
    "llama": ModelSpec(build_llama, (128,), "Llama-style decoder: RMSNorm, rotary, SwiGLU, grouped-query attention "
                       "(model.n_layers/hidden/heads/kv_heads/ffn_hidden/seq_len)", torch.long, 256),
}


def build_model(name: str, num_classes: int | None = None, in_channels: int | None = None, *,
                input_shape: tuple[int, ...] | None = None, input_dtype: torch.dtype = torch.float32,
                config: ModelConfig | None = None, task: str | None = None) -> nn.Module:
    """A registered model, or ``package.module:NAME`` called with the arguments it accepts.

    With ``input_shape`` (one sample's shape, e.g. the dataset's), ``in_channels`` defaults
    to its first entry and one dummy forward pass of the data's dtype checks the model's
    output against ``task`` (the run's: ``classification`` or ``causal_lm``) before training
    starts. Without a task (a library caller), token ids of one dim are taken for causal_lm
    text (the data layout's rule) where that decides something, and the check reads the task
    from the output (3-D logits on token ids: causal_lm).
    Token models (``gpt``, ``llama``) take their sizes from ``config`` (the ``model`` section) and
    ``num_classes`` as the data's vocabulary."""
    spec = REGISTRY.get(name)
    if spec is not None and spec.input_dtype == torch.long:
        model = spec.factory(num_classes or spec.num_classes, config=config, input_shape=input_shape,
                             input_dtype=input_dtype, name=name)
        return model if config is None else mark_family(model, config)
    num_classes = num_classes or (spec.num_classes if spec else 10)
    if in_channels is None and input_shape is not None:
        in_channels = input_shape[0]
    if ":" in name:
        cfg = config or ModelConfig(name=name)
        offered = user_offers(cfg, num_classes, in_channels, input_shape, input_dtype,
                              task or _data_task(input_shape, input_dtype))
        model = build_user_model(name, offered)
        check_sync_batchnorm(model, name)
        if cfg.use_model_loss:
            pass_labels(model)
    elif name in REGISTRY:
        spec = REGISTRY[name]
        model = spec.factory(num_classes=num_classes, in_channels=spec.input_shape[0] if in_channels is None
                             else in_channels)
    else:
        raise ModelError(f"model.name={name!r} is not registered; choose one of: {', '.join(REGISTRY)}, "
                         "or give a factory or nn.Module class as package.module:NAME")
    if input_shape is not None:
        check_model_output(model, name, input_shape, num_classes, input_dtype, task=task,
                           use_model_loss=config is not None and config.use_model_loss and ":" in name)
    return model if config is None else mark_family(model, config)


def resolve_num_classes(config: ModelConfig, data_classes: int, input_shape: tuple[int, ...],
                        input_dtype: torch.dtype, data_name: str) -> int:
    """``model.num_classes``, else the data's class count, else the output width of the user's model
    built with its own defaults (one dummy forward, as the output check does); a ConfigError when
    none of them tells."""
    count = config.num_classes or data_classes or infer_num_classes(config.name, input_shape, input_dtype, config)
    if not count:
        raise ConfigError(f"data.name={data_name}: the number of classes is unknown; hint: set model.num_classes, "
                          "or give num_classes in the mapping (or a classes list on the dataset), or let the "
                          "model's factory default its num_classes (its output width is then the class count)")
    return count


def infer_num_classes(name: str, input_shape: tuple[int, ...], input_dtype: torch.dtype,
                      config: ModelConfig | None = None) -> int | None:
    """The class count a user's model (``package.module:NAME``) declares by its output width:
    built in host memory without ``num_classes`` (its own default), one dummy forward of two
    samples, the width of its ``(batch, C)`` logits. None for a registered model, a factory that
    requires ``num_classes``, or an output of another shape."""
    if ":" not in name:
        return None
    cfg = config or ModelConfig(name=name)
    offered = user_offers(cfg, 0, input_shape[0] if input_shape else None, input_shape, input_dtype,
                          "classification")
    del offered["num_classes"]
    try:
        factory_kwargs(name, load_factory(name), offered)  # a ModelError when it requires num_classes
    except ModelError:
        return None
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):  # the run's random streams stay untouched
        model = build_user_model(name, offered)
        return output_width(model, input_shape, input_dtype)


def check_sync_batchnorm(model: nn.Module, name: str) -> None:
    """A user's ``SyncBatchNorm`` syncs over NCCL only: at 2+ gloo ranks the first training step
    would fail inside torch, so say it now, naming the layer (exit 2)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return  # one process: torch's SyncBatchNorm is a plain BatchNorm there
    if dist.get_backend() == "nccl":
        return
    layer = next((n for n, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)), None)
    if layer is not None:
        raise ModelError(f"model.name={name!r} holds torch.nn.SyncBatchNorm ({layer}), which needs CUDA GPUs and the "
                         f"NCCL backend; this run uses {dist.get_backend()} over {dist.get_world_size()} ranks; hint: "
                         "a plain BatchNorm (hpctrain keeps the ranks' BatchNorm buffers in step), or run on GPUs")


def _data_task(input_shape: tuple[int, ...] | None, input_dtype: torch.dtype) -> str:
    """The data layout's rule (hpctrain.data.build.data_layout) when the caller names no task."""
    tokens = not input_dtype.is_floating_point and input_shape is not None and len(input_shape) == 1
    return CAUSAL_LM if tokens else "classification"


def user_offers(cfg: ModelConfig, num_classes: int, in_channels: int | None, input_shape: tuple[int, ...] | None,
                input_dtype: torch.dtype, task: str) -> dict[str, int]:
    """What a user factory may take (:data:`hpctrain.models.user.SUPPLIED`): ``num_classes``
    (for causal_lm: the data's vocabulary), ``in_channels``, and for token models ``vocab_size``
    (``model.vocab``, else the data's vocabulary for causal_lm) and ``seq_len`` (the data's
    sequence length, else ``model.seq_len``)."""
    offered = {"num_classes": num_classes} | ({} if in_channels is None else {"in_channels": in_channels})
    vocab = cfg.vocab or (num_classes if task == CAUSAL_LM else None)
    if vocab is not None:
        offered["vocab_size"] = vocab
    if task == CAUSAL_LM or not input_dtype.is_floating_point:
        offered["seq_len"] = input_shape[0] if input_shape else cfg.seq_len
    return offered


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
