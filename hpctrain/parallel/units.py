"""The units a model is wrapped in one at a time (FSDP shards, activation checkpointing,
per-block compile): its transformer blocks, else its direct children that hold parameters."""

from __future__ import annotations

from torch import nn


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one: the transformer blocks, else the direct children that hold parameters."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    return [child for child in model.children() if any(True for _ in child.parameters())]
