"""User models given as ``model.name=package.module:NAME``, as users actually write them.

``NAME`` may be a factory function or an ``nn.Module`` subclass, taking any of
``num_classes``, ``in_channels``, ``vocab_size``, ``seq_len`` (see :data:`SUPPLIED`), none, or
``**kwargs``: hpctrain passes only the arguments its signature accepts. Before training, one
forward pass on a dummy batch of the dataset's input shape and dtype (integer token ids stay
integer) checks that the model runs and returns what the task reads: logits ``(batch,
num_classes)`` for classification, ``(batch, seq_len, vocab)`` for ``causal_lm``, as a tensor, a
tuple, a dict or a ``ModelOutput`` (:mod:`hpctrain.models.outputs`). A wrong factory fails with a
message naming ``model.name``, the task and the expected shape instead of a traceback from deep
inside the first training step.

Loss convention: a model may return logits or log-probabilities (``log_softmax``, as in
the PyTorch MNIST example). Both train identically under ``F.cross_entropy``: it applies
``log_softmax`` first, which leaves log-probabilities unchanged (their logsumexp is 0),
so the loss equals ``nll_loss``; and its extra gradient term lies in the null space of
``log_softmax``'s Jacobian, so the gradients equal too (tests/models/test_models.py checks both
numerically). Probabilities (a final ``softmax``) are not log-probabilities: a warning says so.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hpctrain.core.errors import UserError
from hpctrain.core.section import load_import_path
from hpctrain.models.outputs import OutputError, attach_labels, describe, logits_of, loss_of

log = logging.getLogger("hpctrain")
# The only arguments hpctrain can give a factory: num_classes (model.num_classes or the data's),
# in_channels (the input's first dim), vocab_size (model.vocab, or the data's vocabulary for
# causal_lm), seq_len (token data: the data's sequence length, else model.seq_len).
SUPPLIED = ("num_classes", "in_channels", "vocab_size", "seq_len")
CAUSAL_LM = "causal_lm"


class ModelError(UserError):
    """``model.name`` cannot be loaded, built, or run on the data; the message says why."""


def load_factory(name: str) -> Callable[..., Any]:
    """The object ``package.module:NAME`` names (``NAME`` may be dotted: ``module:Class.create``)."""
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ModelError(f"model.name={name!r} must look like package.module:NAME")
    obj = load_import_path("model.name", name, ModelError)
    if not callable(obj):
        raise ModelError(f"model.name={name!r} is a {type(obj).__name__}, not a factory or nn.Module class")
    return obj


def factory_kwargs(name: str, factory: Callable[..., Any], offered: dict[str, int]) -> dict[str, int]:
    """The subset of ``offered`` that the signature of ``factory`` accepts (**kwargs: all)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature (some builtins / C extensions): pass what is conventional
        return {"num_classes": offered["num_classes"]}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    required = [p.name for p in params.values() if p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                and p.name not in offered]
    if required:
        offers = ", ".join(offered)
        raise ModelError(f"model.name={name!r} requires {', '.join(map(repr, required))}, which hpctrain cannot "
                         f"supply here (it passes {offers}; vocab_size needs model.vocab or causal_lm data, seq_len "
                         "token data); hint: give them defaults, or wrap the model in a function without them")
    return {k: v for k, v in offered.items() if k in params
            and params[k].kind is not inspect.Parameter.POSITIONAL_ONLY}


def build_user_model(name: str, offered: dict[str, int]) -> nn.Module:
    """Call the factory (or class) with the arguments of ``offered`` it accepts; any failure is a ModelError."""
    factory = load_factory(name)
    kwargs = factory_kwargs(name, factory, offered)
    try:
        model = factory(**kwargs)
    except Exception as err:  # noqa: BLE001 - user code: report it with the key that named it
        shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        raise ModelError(f"model.name={name!r}: calling it as {name.partition(':')[2]}({shown}) raised "
                         f"{type(err).__name__}: {err}") from err
    if not isinstance(model, nn.Module):
        raise ModelError(f"model.name={name!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def check_model_output(model: nn.Module, name: str, input_shape: tuple[int, ...], num_classes: int,
                       input_dtype: torch.dtype = torch.float32, *, task: str | None = None,
                       use_model_loss: bool = False) -> None:
    """One forward pass on a dummy batch of the data's shape and dtype: it runs and gives the
    task's logits (``num_classes``: the classes, or for ``causal_lm`` the data's vocabulary).

    Eval mode, no grad, and the RNG state restored, so the check changes neither the
    weights, the BatchNorm statistics nor the random streams of the run that follows. A model
    on the meta device (the FLOP-counting or meta-init copy of the strategies) is not run: its
    forward may need values (Hugging Face models do), and the real build was checked already.
    With ``use_model_loss`` the model also gets labels and must return a ``loss``. ``task``
    None: causal_lm for 3-D logits on token ids, else classification."""
    if _on_meta(model):
        return
    batch = 2
    was_training = model.training
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    inputs = torch.zeros((batch, *input_shape), dtype=input_dtype, device=device)
    tokens = not input_dtype.is_floating_point
    if use_model_loss:  # the labels training gives: the tokens themselves (causal_lm), or class ids (batch,)
        causal = task == CAUSAL_LM or (task is None and tokens and len(input_shape) == 1)
        attach_labels(inputs, inputs if causal else torch.zeros(batch, dtype=torch.long, device=device), None)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            out = model(inputs)
    except Exception as err:  # noqa: BLE001 - user code: report it with the key that named it
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelError(f"model.name={name!r} does not run on the data's input shape {tuple(input_shape)} "
                         f"({input_dtype}): {type(err).__name__}: {first}; hint: check data.name or the model's "
                         "input layer") from err
    finally:
        model.train(was_training)
    logits = _logits(out, name, task)
    if task is None:
        task = CAUSAL_LM if tokens and logits.dim() == len(input_shape) + 2 else "classification"
    if task == CAUSAL_LM:
        _check_token_logits(model, logits, name, batch, input_shape, num_classes)
    else:
        _check_logits(logits, name, batch, num_classes)
    if use_model_loss and not _is_scalar(loss_of(out)):
        raise ModelError(f"model.use_model_loss=true, but model.name={name!r} returned {describe(out)} when called "
                         "with labels=, no scalar `loss`; hint: model.use_model_loss=false (the task's "
                         "cross-entropy on the logits), or return a dict / ModelOutput with `loss`")


def output_width(model: nn.Module, input_shape: tuple[int, ...], input_dtype: torch.dtype) -> int | None:
    """The width of the ``(batch, C)`` logits ``model`` returns for two dummy samples (eval mode,
    no grad: nothing of the model changes); None when it fails or returns another shape."""
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()
            logits = logits_of(model(torch.zeros((2, *input_shape), dtype=input_dtype)))
    except Exception:  # noqa: BLE001 - no width to read: the caller asks for num_classes instead
        return None
    finally:
        model.train(was_training)
    return int(logits.shape[1]) if logits.dim() == 2 and logits.shape[0] == 2 else None


def _on_meta(model: nn.Module) -> bool:
    first = next(iter(model.parameters()), None)
    return first.is_meta if first is not None else torch.get_default_device().type == "meta"


def _is_scalar(value: torch.Tensor | None) -> bool:
    return value is not None and value.numel() == 1


def _logits(out: Any, name: str, task: str | None) -> torch.Tensor:
    try:
        logits = logits_of(out)
    except OutputError as err:
        raise ModelError(f"model.name={name!r}{f' (task {task})' if task else ''}: {err}") from None
    if not logits.is_floating_point():
        raise ModelError(f"model.name={name!r} returned {logits.dtype} outputs; expected float logits")
    return logits


def model_vocab(model: nn.Module) -> int | None:
    """The vocabulary a language model declares: ``config.vocab_size`` (Hugging Face), else the
    output layer's width (``get_output_embeddings()``); None when it declares neither."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    width = getattr(head, "out_features", None)
    return width if isinstance(width, int) else None


def _check_token_logits(model: nn.Module, logits: torch.Tensor, name: str, batch: int,
                        input_shape: tuple[int, ...], data_vocab: int) -> None:
    """causal_lm: ``(batch, seq_len, V)``, V the vocabulary the model declares (any, when it
    declares none), and every token id of the data inside it."""
    declared = model_vocab(model)
    shape = tuple(logits.shape)
    if shape[:-1] != (batch, *input_shape) or (declared is not None and shape[-1] != declared):
        expected = (batch, *input_shape, declared or data_vocab)
        source = "its config.vocab_size / output layer" if declared else "the data's vocabulary"
        raise ModelError(f"model.name={name!r} returned logits of shape {shape} for {batch} sequences of "
                         f"{tuple(input_shape)} tokens; task causal_lm expects {expected} = (batch, seq_len, vocab), "
                         f"vocab {expected[-1]} from {source}; hint: return the language-model head's logits for "
                         "every position (not only the last, not a pooled output)")
    if shape[-1] < data_vocab:
        raise ModelError(f"model.name={name!r} has a vocabulary of {shape[-1]}, smaller than the data's ({data_vocab} "
                         "token ids); hint: build it with vocab_size >= the data's (a factory taking vocab_size gets "
                         "the data's)")


def _check_logits(out: torch.Tensor, name: str, batch: int, num_classes: int) -> None:
    if tuple(out.shape) != (batch, num_classes):
        raise ModelError(f"model.name={name!r} returned shape {tuple(out.shape)} for a batch of {batch}; task "
                         f"classification expects {(batch, num_classes)} = (batch, num_classes); hint: set "
                         "model.num_classes, or let the factory take num_classes")
    if bool((out >= 0).all()) and torch.allclose(out.float().sum(1).cpu(), torch.ones(batch), atol=1e-4):
        log.warning("model.name=%s seems to end in softmax (outputs sum to 1): cross-entropy expects logits or "
                    "log_softmax outputs; hint: return log_softmax (or the logits)", name)
