"""A model family: everything a parallel strategy needs to know about a kind of model, in one
registered bundle, so ``hpctrain.parallel`` applies plans and names no model.

A :class:`ModelFamily` holds

* ``matches``: which built models are of the family (``family_of(model)`` asks each registered
  family, the latest registered first; a model built under ``model.family=...`` is marked);
* ``build``: the builder of a built-in model (the registry's factory), None for users' models;
* ``shape``: its :class:`~hpctrain.models.shape.TransformerShape` from the ``model`` config
  section, for the estimator, the planner and the pipeline checks;
* ``tensor_plan``: a :class:`TensorPlan` (module-name patterns -> colwise / rowwise /
  sequence_parallel in each block, the vocabulary-parallel ends, the heads tp must divide);
* ``pipeline_split``: a :class:`PipelineSplit` (the blocks, what only the first and last stage
  hold, and the stage module that runs a cut model);
* ``blocks``: the repeated layers, the units of FSDP and of activation checkpointing;
* ``context_parallel``: makes a built model compute its share of each sequence over a
  :class:`~hpctrain.models.attention.SequenceSplit` (``parallel.cp``; None: the family has no cp).

Built in: ``gpt``, ``llama`` (hpctrain's), ``hf-llama`` (Hugging Face ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``: :mod:`hpctrain.models.hf_llama`) and ``default``,
the layout rule every other model gets (transformer blocks as ``blocks``, projections named
``q, k, v, o, gate, up, down``; see docs/models.md). Register your own with
:func:`register_family` or ``model.family=package.module:FAMILY``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from torch import nn

from hpctrain.config.model import ModelConfig
from hpctrain.core.section import load_import_path
from hpctrain.models import hf_llama
from hpctrain.models.attention import SequenceSplit, use_split
from hpctrain.models.gpt import GPT, build_gpt
from hpctrain.models.llama import Llama, LlamaShape, build_llama, moe_shape
from hpctrain.models.moe import ExpertPlan, moe_expert_plan
from hpctrain.models.shape import TransformerShape
from hpctrain.models.user import ModelError

LAYER_STYLES = ("colwise", "rowwise", "sequence_parallel")  # in a block
END_STYLES = ("embedding", "head")  # vocabulary-parallel token embedding / output projection
FAMILY_ATTR = "_hpctrain_family"  # a model built under model.family=... carries its family's name


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` matches the module's name in its block, or its tail: ``q`` matches ``attn.q``."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")


@dataclass(frozen=True)
class TensorPlan:
    """How tensor parallelism splits a model (applied by :mod:`hpctrain.parallel.tensor`).

    ``blocks``: the dotted path of the ``nn.ModuleList`` of transformer blocks. ``layers``: in a
    block, a module-name pattern (fnmatch, matched against the name or its dotted tail) ->
    ``colwise`` (an ``nn.Linear`` split by output features: q, k, v, gate, up), ``rowwise`` (by
    input features, partial sums reduced: o, down) or ``sequence_parallel`` (a norm that runs on
    a sequence shard under ``parallel.sequence_parallel``); ``norms``: module types that are
    sequence-parallel too. ``ends``: paths in the model -> ``embedding`` / ``head``, split by
    vocabulary rows. ``heads``: (projection pattern, what) pairs whose ``out_features //
    head_dim`` (``head_dim`` of the projection's parent) tp must divide; ``divide``: integer
    attributes of a block's modules that hold head counts and must become the local ones."""

    blocks: str
    layers: Mapping[str, str]
    ends: Mapping[str, str] = field(default_factory=dict)
    norms: tuple[type[nn.Module], ...] = ()
    heads: tuple[tuple[str, str], ...] = ()
    divide: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for styles, allowed in ((self.layers, LAYER_STYLES), (self.ends, END_STYLES)):
            for pattern, style in styles.items():
                if style not in allowed:
                    raise ValueError(f"tensor plan: {pattern!r} -> {style!r} is not one of {', '.join(allowed)}")

    def style(self, name: str, module: nn.Module) -> str | None:
        """The style of the module ``name`` of a block (None: left whole, replicated)."""
        for pattern, style in self.layers.items():
            if _matches(name, pattern) and (style == "sequence_parallel") != isinstance(module, nn.Linear):
                return style
        return "sequence_parallel" if self.norms and isinstance(module, self.norms) else None

    @property
    def column_names(self) -> list[str]:
        return [pattern for pattern, style in self.layers.items() if style == "colwise"]


@dataclass(frozen=True)
class PipelineSplit:
    """How pipeline parallelism cuts a model (applied by :mod:`hpctrain.parallel.pipeline`):
    ``blocks``, the dotted path of the ``nn.ModuleList`` cut into consecutive stages; ``first``
    and ``last``, the paths only the first / last stage keeps (the others set them to None);
    ``stage``, what turns the cut model into the stage module (None: the cut model itself, whose
    ``forward`` skips a None part and takes hidden states without the embedding). A stage keeps
    the whole model's names, with its blocks renumbered from 0."""

    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    stage: Callable[[nn.Module], nn.Module] | None = None


def layout_blocks(model: nn.Module) -> list[nn.Module] | None:
    """The transformer blocks of any model: ``blocks`` (an ``nn.ModuleList``), else the classes a
    Hugging Face model names in ``_no_split_modules`` (outermost first, in module order), else the
    longest ``nn.ModuleList`` of two or more children of one class; None when there are none."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    return transformer_blocks(model)


def transformer_blocks(model: nn.Module) -> list[nn.Module] | None:
    """A model's blocks found from its layout (``_no_split_modules``, else repeated children), or None."""
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


@dataclass(frozen=True)
class ModelFamily:
    """One registered kind of model and its parallel plans (see the module's doc)."""

    name: str
    matches: Callable[[nn.Module], bool] | None = None
    build: Callable[..., nn.Module] | None = None
    shape: Callable[[ModelConfig], TransformerShape] | None = None
    tensor_plan: Callable[[nn.Module], TensorPlan | None] | None = None
    pipeline_split: Callable[[nn.Module], PipelineSplit | None] | None = None
    blocks: Callable[[nn.Module], list[nn.Module] | None] = layout_blocks
    # parallel.ep: the model's mixture-of-experts layers (hpctrain.models.moe; hpctrain.parallel.expert applies it)
    expert_plan: Callable[[nn.Module], ExpertPlan | None] | None = None
    # parallel.cp: make the model compute its share of each sequence over a split (None: no cp;
    # hpctrain.parallel.context applies it; gpt and llama: hpctrain.models.attention.use_split)
    context_parallel: Callable[[nn.Module, SequenceSplit], None] | None = None

    def tensor_plan_of(self, model: nn.Module) -> TensorPlan | None:
        return self.tensor_plan(model) if self.tensor_plan is not None else None

    def pipeline_split_of(self, model: nn.Module) -> PipelineSplit | None:
        return self.pipeline_split(model) if self.pipeline_split is not None else None

    def expert_plan_of(self, model: nn.Module) -> ExpertPlan | None:
        return self.expert_plan(model) if self.expert_plan is not None else None


# ---------------------------------------------------------------- the `blocks` layout (gpt, llama, users')

BLOCK_LAYERS = {"q": "colwise", "k": "colwise", "v": "colwise", "gate": "colwise", "up": "colwise",
                "o": "rowwise", "down": "rowwise"}
BLOCK_HEADS = (("q", "heads"), ("k", "key/value heads (model.kv_heads)"))
VOCAB_ENDS = {"tok_emb": "embedding", "head": "head"}


def blocks_tensor_plan(model: nn.Module) -> TensorPlan | None:
    """``blocks`` split by the names q, k, v, gate, up (colwise) and o, down (rowwise); norms
    sequence-parallel; the ends ``tok_emb`` and ``head`` by vocabulary when the model says
    ``vocab_parallel = True`` (hpctrain's llama)."""
    if not isinstance(getattr(model, "blocks", None), nn.ModuleList):
        return None
    ends = VOCAB_ENDS if getattr(model, "vocab_parallel", False) else {}
    return TensorPlan(blocks="blocks", layers=BLOCK_LAYERS, ends=ends, norms=(nn.LayerNorm, nn.RMSNorm),
                      heads=BLOCK_HEADS)


def blocks_pipeline_split(model: nn.Module) -> PipelineSplit | None:
    """``blocks`` cut into stages; the top-level children before it run on the first stage, those after on the last."""
    names = [name for name, _ in model.named_children()]
    if "blocks" not in names or not isinstance(getattr(model, "blocks", None), nn.ModuleList):
        return None
    cut = names.index("blocks")
    return PipelineSplit(blocks="blocks", first=tuple(names[:cut]), last=tuple(names[cut + 1:]))


def gpt_shape(cfg: ModelConfig) -> TransformerShape:
    """GPT-2's layout (learned positions, LayerNorm, GELU MLP, biases); vocabulary model.vocab or 256 (bytes)."""
    return TransformerShape(layers=cfg.n_layers, hidden=cfg.hidden, heads=cfg.heads, seq_len=cfg.seq_len,
                            vocab=cfg.vocab or 256, tied=cfg.tie_weights, dropout=cfg.dropout > 0,
                            bias="all" if cfg.bias else "none")


def llama_shape(cfg: ModelConfig) -> TransformerShape:
    return LlamaShape(vocab=cfg.vocab or 256, seq_len=cfg.seq_len, n_layers=cfg.n_layers, hidden=cfg.hidden,
                      heads=cfg.heads, kv_heads=cfg.kv_heads, ffn_hidden=cfg.ffn_hidden,
                      tie_weights=cfg.tie_weights, moe=moe_shape(cfg)).transformer()


def _instance_of(kind: type[nn.Module]) -> Callable[[nn.Module], bool]:
    return lambda model: isinstance(model, kind)


DEFAULT = ModelFamily("default", tensor_plan=blocks_tensor_plan, pipeline_split=blocks_pipeline_split)
GPT_FAMILY = replace(DEFAULT, name="gpt", matches=_instance_of(GPT), build=build_gpt, shape=gpt_shape,
                     context_parallel=use_split)
LLAMA_FAMILY = replace(DEFAULT, name="llama", matches=_instance_of(Llama), build=build_llama, shape=llama_shape,
                       expert_plan=moe_expert_plan, context_parallel=use_split)


# ---------------------------------------------------------------- Hugging Face Llama, Mistral, Qwen2

HF_TENSOR_PLAN = TensorPlan(blocks=hf_llama.BLOCKS, layers=hf_llama.LAYERS, ends=hf_llama.ENDS, heads=hf_llama.HEADS,
                            divide=hf_llama.DIVIDE)
HF_PIPELINE_SPLIT = PipelineSplit(blocks=hf_llama.BLOCKS, first=hf_llama.FIRST, last=hf_llama.LAST,
                                  stage=hf_llama.CausalLMStage)


def _hf_or_stage(model: nn.Module) -> bool:
    return hf_llama.is_llama_family(model) or isinstance(model, hf_llama.CausalLMStage)


HF_LLAMA_FAMILY = ModelFamily("hf-llama", matches=_hf_or_stage, tensor_plan=lambda _model: HF_TENSOR_PLAN,
                              pipeline_split=lambda _model: HF_PIPELINE_SPLIT, context_parallel=hf_llama.use_split)


# ---------------------------------------------------------------- the registry

_FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (GPT_FAMILY, LLAMA_FAMILY, HF_LLAMA_FAMILY)}


def load_family(path: str, key: str = "model.family") -> ModelFamily:
    """The :class:`ModelFamily` that ``package.module:NAME`` names (a ModelError otherwise)."""
    if ":" not in path:
        raise ModelError(f"{key}={path!r} is neither a registered family ({', '.join(_FAMILIES)}) nor an import "
                         "path package.module:NAME of a ModelFamily")
    family = load_import_path(key, path, ModelError)
    if not isinstance(family, ModelFamily):
        raise ModelError(f"{key}={path!r} is a {type(family).__name__}, not a hpctrain.models.family.ModelFamily")
    return family


def register_family(name: str, family: ModelFamily | str) -> ModelFamily:
    """Register ``family`` (or the one ``package.module:NAME`` names) under ``name``, replacing
    one of that name; models it ``matches`` get its plans from then on, before earlier families'."""
    found = load_family(family) if isinstance(family, str) else family
    if not isinstance(found, ModelFamily):
        raise ModelError(f"register_family({name!r}, ...) takes a ModelFamily or an import path, not "
                         f"{type(found).__name__}")
    found = found if found.name == name else replace(found, name=name)
    _FAMILIES.pop(name, None)  # re-registered: it is the latest, asked first
    _FAMILIES[name] = found
    return found


def family_of(model_or_name: nn.Module | str) -> ModelFamily:
    """The family registered as this name, or of this built model (its mark, else the latest
    registered family that matches it); the ``default`` layout family otherwise."""
    if isinstance(model_or_name, str):
        return _FAMILIES.get(model_or_name, DEFAULT)
    marked = getattr(model_or_name, FAMILY_ATTR, None)
    if isinstance(marked, str) and marked in _FAMILIES:
        return _FAMILIES[marked]
    for family in reversed(_FAMILIES.values()):
        if family.matches is not None and family.matches(model_or_name):
            return family
    return DEFAULT


def family_for(cfg: ModelConfig) -> ModelFamily | None:
    """The family a ``model`` config section names: ``model.family`` (a registered name, or an
    import path, registered on first use), else the family registered as ``model.name``; None
    when neither (a user's model: its family is found from the built model)."""
    if cfg.family:
        known = _FAMILIES.get(cfg.family)
        if known is not None:
            return known
        family = load_family(cfg.family)
        return register_family(family.name, family)
    return _FAMILIES.get(cfg.name)


def mark_family(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Under ``model.family=...``, mark the built model as that family's (whatever it matches)."""
    family = family_for(cfg) if cfg.family else None
    if family is not None:
        setattr(model, FAMILY_ATTR, family.name)
    return model
