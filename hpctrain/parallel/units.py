"""The units a model is wrapped in one at a time (FSDP shards, activation checkpointing,
per-block compile): its transformer blocks, else its direct children that hold parameters.

The blocks are found from the model's layout. Hugging Face models name the classes that must
stay whole in ``_no_split_modules`` (``GPT2Block``, ``LlamaDecoderLayer``, ``BertLayer``...):
those modules, outermost first, in module order. Other models: the longest ``nn.ModuleList`` of
two or more children of one class (hpctrain's ``gpt.blocks``, a user's ``self.layers``).
"""

from __future__ import annotations

from torch import nn


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules wrapped one by one: the transformer blocks (a pipeline stage's ``blocks`` may hold
    one), else the direct children that hold parameters, a container's children in its place (a
    ``ModuleList`` has no forward to wrap)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    return transformer_blocks(model) or [unit for child in model.children() for unit in _units_of(child)]


def _units_of(child: nn.Module) -> list[nn.Module]:
    if not any(True for _ in child.parameters()):
        return []
    if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
        return [unit for inner in child.children() for unit in _units_of(inner)]
    return [child]


def transformer_blocks(model: nn.Module) -> list[nn.Module] | None:
    """The model's blocks (see the module's doc), or None."""
    return _no_split_blocks(model) or _repeated_children(model)


def _no_split_blocks(model: nn.Module) -> list[nn.Module] | None:
    names = {name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or ())}
    if not names:
        return None
    found: list[nn.Module] = []
    inside: set[int] = set()  # the submodules of a block found already: a block is never split
    for module in model.modules():
        if module is model or id(module) in inside or type(module).__name__ not in names:
            continue
        found.append(module)
        inside.update(id(sub) for sub in module.modules())
    return found or None


def _repeated_children(model: nn.Module) -> list[nn.Module] | None:
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > max(1, len(best)) \
                and len({type(child) for child in module}) == 1:
            best = list(module)
    return best or None
