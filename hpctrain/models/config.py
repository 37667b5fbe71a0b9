"""The ``model`` config section."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.section import opt, positive


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = opt("mnist_cnn", "Registered model (`hpctrain models`) or a user model as `package.module:NAME` (a factory or an nn.Module class).")
    num_classes: int | None = opt(None, "Output classes; default: taken from the dataset.")

    def __post_init__(self) -> None:
        positive("model", self, "num_classes")
