"""Model registry: built-in names, or any user factory given as ``package.module:function``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from hpctrain.config import ConfigError
from hpctrain.models.mnist_net import MnistCNN
from hpctrain.models.resnet import ResNet18
from hpctrain.models.simple_cnn import SimpleCNN


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


def build_model(name: str, num_classes: int = 10, in_channels: int | None = None) -> nn.Module:
    """A registered model, or ``package.module:factory`` called as ``factory(num_classes=...)``."""
    if ":" in name:
        return _user_model(name, num_classes)
    if name not in REGISTRY:
        raise ConfigError(
            f"model.name={name!r} is not registered; choose one of: {', '.join(REGISTRY)} "
            "or give a factory as package.module:function"
        )
    spec = REGISTRY[name]
    channels = spec.input_shape[0] if in_channels is None else in_channels
    return spec.factory(num_classes=num_classes, in_channels=channels)


def _user_model(name: str, num_classes: int) -> nn.Module:
    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"model.name={name!r}: cannot load {attr!r} from {module_name!r} ({err})") from err
    model = factory(num_classes=num_classes)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name={name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
