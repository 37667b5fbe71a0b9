"""Inputs a model takes by name: a batch whose inputs are a dict (``input_ids``,
``attention_mask``, ``token_type_ids``, ...) reaches the model as ``model(**inputs)``.

The strategies (DDP, FSDP2, DeepSpeed) call the model with one positional input and pass that
object through, so a dict travels to the user's module as it is; a forward pre-hook there
(:func:`expand_dict_inputs`, registered when the loop builds the model) turns ``model(inputs)``
into ``model(**inputs)``. Only the keys the module's ``forward`` names are passed (all of them
when it takes ``**kwargs``), so a table's extra column never breaks a model that does not read
it (a forward that takes ``**kwargs`` gets the keys it names, or every key when it names none:
Hugging Face models name their inputs, and an extra ``idx`` column must not reach their
``**kwargs``). Evaluation calls :func:`call_model`, which does the same without the hook (a
user's own model in ``evaluate()``).

Packed documents (``{"tokens", "doc_ids"}``, :mod:`hpctrain.tasks.causal_lm`) reach the model as
``model(tokens, doc_ids=doc_ids)``, the tokens positionally (so a Hugging Face model's
``input_ids`` or a user's ``forward(x)`` takes them too). A forward that names no ``doc_ids``
gets the tokens alone: it trains, the loss still never predicts across a document boundary, but
its attention crosses documents within a window (as GPT-2-style packing does); that is warned
once per model, not refused, so any causal LM can read packed data. A Hugging Face Llama-family
model (PEFT-wrapped too) gets ``position_ids`` that restart at 0 at each document instead, as
``transformers``' own packing collator (``DataCollatorWithFlattening``) gives them: with no
``attention_mask`` and no cache (``use_cache=False``) transformers builds the block-diagonal causal
mask from them (SDPA, eager) or runs flash-attention's variable-length kernel, so no token attends
across a document.

Under pipeline parallel (:func:`stage_inputs`) the main input goes to the first stage and the
other named inputs (``doc_ids``, ``attention_mask``) to every stage, which masks alike.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hpctrain.core.errors import UserError
from hpctrain.data.batch import INPUT_KEYS
from hpctrain.models import build_model
from hpctrain.models.attention import document_positions
from hpctrain.models.hf_llama import takes_document_positions

log = logging.getLogger("hpctrain")
IGNORE_INDEX = -100  # a target position that counts nowhere (padding tokens), as torch's cross-entropy


class ModelInputs(dict):  # type: ignore[type-arg]  # str -> tensor
    """A batch's named inputs: a dict that can carry the labels a model with its own loss takes
    (hpctrain.models.outputs.attach_labels sets an attribute, which a plain dict cannot hold)."""


def model_inputs(inputs: Any) -> Any:
    """What the strategy hands the model: a tensor as it is, a dict as :class:`ModelInputs`."""
    return ModelInputs(inputs) if isinstance(inputs, Mapping) and not isinstance(inputs, ModelInputs) else inputs


Signature = tuple[frozenset[str], bool]  # the names forward takes by keyword, and whether it takes **kwargs


def forward_names(module: nn.Module) -> Signature:
    """The keyword names ``module.forward`` takes, and whether it also takes ``**kwargs``."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return frozenset(), True
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = frozenset(n for n, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                                 inspect.Parameter.KEYWORD_ONLY))
    return named, var_kw


def keyword_inputs(module: nn.Module, inputs: Mapping[str, Any], signature: Signature | None = None
                   ) -> dict[str, Any]:
    """The entries of ``inputs`` that ``module.forward`` names; all of them when it names none
    of them but takes ``**kwargs``."""
    names, var_kw = forward_names(module) if signature is None else signature
    kept = {k: v for k, v in inputs.items() if k in names}
    if not kept and var_kw:
        return dict(inputs)
    if not kept:
        raise UserError(f"the model's forward takes none of the batch's inputs {sorted(inputs)} (it takes "
                        f"{sorted(names)}); hint: name the forward's parameters after the data's columns, or choose "
                        "them with data.input_columns / data.input_key")
    return kept


def call_model(net: nn.Module, inputs: Any) -> Any:
    """``net(inputs)``, or ``net(**inputs)`` (the keys its forward names) for a dict."""
    if isinstance(inputs, Mapping):
        packed = packed_call(net, inputs, forward_names(net))
        if packed is not None:
            return net(*packed[0], **packed[1])
        return net(**keyword_inputs(net, inputs))
    return net(inputs)


def packed_call(module: nn.Module, inputs: Mapping[str, Any], signature: Signature
                ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Packed documents' ``(tokens,), {doc_ids}`` for ``module`` (no ``doc_ids`` where its forward
    names none: warned once); None for any other inputs."""
    if "doc_ids" not in inputs or "tokens" not in inputs:
        return None
    if "doc_ids" in signature[0]:
        return (inputs["tokens"],), {"doc_ids": inputs["doc_ids"]}
    if takes_document_positions(module):  # transformers masks per document by these (its packing collator's)
        # no cache: transformers looks for packed sequences only without one (its default builds one)
        return (inputs["tokens"],), {"position_ids": document_positions(inputs["doc_ids"]), "use_cache": False}
    _warn_crossing(module)
    return (inputs["tokens"],), {}


def _warn_crossing(module: nn.Module) -> None:
    if not getattr(module, "_hpctrain_warned_doc_ids", False):
        module.__dict__["_hpctrain_warned_doc_ids"] = True  # once per model, not per step (not a submodule)
        log.warning("%s.forward takes no doc_ids: its attention crosses the packed documents of a window (the loss "
                    "still predicts no token across a boundary); hint: a model with forward(tokens, doc_ids=None) "
                    "(gpt, llama), or data.packing=windows", type(module).__name__)


def stage_inputs(module: nn.Module, inputs: Any, signature: Signature | None = None
                 ) -> tuple[torch.Tensor, dict[str, Any]]:
    """A pipeline's inputs for stage module ``module``: the main input (the first stage's positional
    one: the tokens, ``input_ids``) and the keywords every stage takes (``doc_ids``, an
    ``attention_mask``: the ones its forward names). A stage that names no ``doc_ids`` gets the
    tokens alone (warned once, as one process's model)."""
    if not isinstance(inputs, Mapping):
        return inputs, {}
    names = (forward_names(module) if signature is None else signature)[0]
    key = next((k for k in ("tokens", *INPUT_KEYS) if k in inputs), next(iter(inputs)))
    if "doc_ids" in inputs and "doc_ids" not in names:
        _warn_crossing(module)
    return inputs[key], {k: v for k, v in inputs.items() if k != key and k in names}


def expand_dict_inputs(model: nn.Module) -> RemovableHandle:
    """A forward pre-hook on ``model``: ``model(dict)`` runs as ``model(**dict)`` (the keys its
    forward names); keywords already given (``labels=``, from the labels hook) are kept."""
    return model.register_forward_pre_hook(_ExpandDict(forward_names(model)), with_kwargs=True)


class _ExpandDict:
    """:func:`expand_dict_inputs`' hook; an object, not a closure, so the model still pickles (a
    factory that loads weights sends its structure to the other ranks, hpctrain.parallel.meta)."""

    def __init__(self, signature: Signature) -> None:
        self.names = signature  # once: the hook runs on every forward

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if len(args) != 1 or not isinstance(args[0], Mapping):
            return None
        packed = packed_call(module, args[0], self.names)
        if packed is not None:
            return packed[0], {**packed[1], **kwargs}
        return (), {**keyword_inputs(module, args[0], self.names), **kwargs}


def padding_positions(inputs: Any) -> torch.Tensor | None:
    """Where a dict's ``attention_mask`` is 0 (padding tokens), or None when it has none."""
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    return None if mask is None else mask == 0


def real_tokens(inputs: Any) -> torch.Tensor | None:
    """The tokens that are not padding (``attention_mask`` 1), a 0-dim tensor; None without a mask."""
    pad = padding_positions(inputs)
    return None if pad is None else (~pad).sum()


def build_task_model(task: Any, name: str, num_classes: int, input_shape: tuple[int, ...], input_dtype: torch.dtype,
                     config: Any) -> nn.Module:
    """``model.name`` built for ``task``: the dummy-forward output check where the task has one
    (classification, causal_lm, multilabel: ``(batch, num_classes)`` logits; regression and custom
    outputs are checked against the targets in the first step instead), and dict inputs expanded."""
    checked = getattr(task, "checks_output", True)
    in_channels = None if checked or not input_shape else input_shape[0]  # checked: build_model derives it
    model = build_model(name, num_classes, in_channels, input_shape=input_shape if checked else None,
                        input_dtype=input_dtype, config=config, task=task.name if checked else None)
    expand_dict_inputs(model)
    # training mode, as a freshly built module is: transformers' from_pretrained returns its model in
    # eval mode, which would train without dropout (and context parallel's gather reads the mode)
    return model.train()
