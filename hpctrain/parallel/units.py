"""The units a model is wrapped in one at a time (FSDP shards, activation checkpointing,
per-block compile): its family's blocks (:attr:`hpctrain.models.family.ModelFamily.blocks`),
else its direct children that hold parameters.

The default family finds the blocks from the model's layout: ``blocks``; the classes a Hugging
Face model names in ``_no_split_modules`` (``GPT2Block``, ``LlamaDecoderLayer``, ``BertLayer``...),
outermost first, in module order; else the longest ``nn.ModuleList`` of two or more children of
one class (a user's ``self.layers``).
"""

from __future__ import annotations

from torch import nn

from hpctrain.models.family import family_of


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules wrapped one by one: the family's blocks (a pipeline stage's may be one), else
    the direct children that hold parameters, a container's children in its place (a
    ``ModuleList`` has no forward to wrap)."""
    return family_of(model).blocks(model) or [unit for child in model.children() for unit in _units_of(child)]


def _units_of(child: nn.Module) -> list[nn.Module]:
    if not any(True for _ in child.parameters()):
        return []
    if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
        return [unit for inner in child.children() for unit in _units_of(inner)]
    return [child]
