"""Model registry: built-in names, or any user model given as ``package.module:NAME``
(a factory or an ``nn.Module`` class; see :mod:`hpctrain.models.user`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hpctrain.models.mnist_net import MnistCNN
from hpctrain.models.resnet import ResNet18
from hpctrain.models.simple_cnn import SimpleCNN
from hpctrain.models.user import ModelError, build_user_model, check_model_output

__all__ = ["REGISTRY", "ModelError", "ModelSpec", "build_model", "check_model_output", "count_parameters"]


@dataclass(frozen=True)
class ModelSpec:
    factory: Callable[..., nn.Module]
    input_shape: tuple[int, ...]
    description: str


REGISTRY: dict[str, ModelSpec] = {
    "mnist_cnn": ModelSpec(MnistCNN, (1, 28, 28), "SCA2025 tutorial MNIST network"),
    "simple_cnn": ModelSpec(SimpleCNN, (3, 32, 32), "workshop baseline CNN for 3x32x32"),
    "resnet18": ModelSpec(ResNet18, (3, 32, 32), "ResNet-18, CIFAR variant"),
}


def build_model(name: str, num_classes: int = 10, in_channels: int | None = None, *,
                input_shape: tuple[int, ...] | None = None, input_dtype: torch.dtype = torch.float32) -> nn.Module:
    """A registered model, or ``package.module:NAME`` called with the arguments it accepts.

    With ``input_shape`` (one sample's shape, e.g. the dataset's), ``in_channels`` defaults
    to its first entry and one dummy forward pass checks the model before training starts."""
    if in_channels is None and input_shape is not None:
        in_channels = input_shape[0]
    if ":" in name:
        model = build_user_model(name, num_classes, in_channels)
    elif name in REGISTRY:
        spec = REGISTRY[name]
        model = spec.factory(num_classes=num_classes, in_channels=spec.input_shape[0] if in_channels is None
                             else in_channels)
    else:
        raise ModelError(f"model.name={name!r} is not registered; choose one of: {', '.join(REGISTRY)}, "
                         "or give a factory or nn.Module class as package.module:NAME")
    if input_shape is not None:
        check_model_output(model, name, input_shape, num_classes, input_dtype)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
