"""What is being trained: a parameter count, from a transformer shape or a model built on the meta device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpctrain.errors import UserError

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class TransformerShape:
    """A GPT-style decoder: ``layers`` blocks of width ``hidden``, ``heads`` attention heads.

    Parameter count (biases and layer norms included, tied input/output embedding, learned
    positions): per block 12h^2 + 13h (QKV 3h^2+3h, projection h^2+h, MLP 4h^2+4h and
    4h^2+h, two layer norms 4h), plus V*h token and s*h position embeddings and the final
    layer norm (2h).
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int

    def __post_init__(self) -> None:
        for flag, value in (("--layers", self.layers), ("--hidden", self.hidden), ("--heads", self.heads),
                            ("--seq-len", self.seq_len), ("--vocab", self.vocab)):
            if value <= 0:
                raise UserError(f"{flag} must be a positive integer, got {value}")
        if self.hidden % self.heads:
            raise UserError(f"--hidden ({self.hidden}) must be divisible by --heads ({self.heads})")

    @property
    def layer_params(self) -> int:
        return 12 * self.hidden ** 2 + 13 * self.hidden

    @property
    def params(self) -> int:
        h = self.hidden
        return self.layers * self.layer_params + (self.vocab + self.seq_len) * h + 2 * h


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
