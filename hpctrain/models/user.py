"""User models given as ``model.name=package.module:NAME``, as users actually write them.

``NAME`` may be a factory function or an ``nn.Module`` subclass, taking no arguments,
``num_classes``, ``in_channels``, both, or ``**kwargs``: hpctrain passes only the
arguments its signature accepts. Before training, one forward pass on a dummy batch of
the dataset's input shape checks that the model runs and returns ``(batch, num_classes)``,
so a wrong factory fails with a message naming ``model.name`` instead of a traceback
from deep inside the first training step.

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

from hpctrain.errors import UserError
from hpctrain.section import load_import_path

log = logging.getLogger("hpctrain")
SUPPLIED = ("num_classes", "in_channels")  # the only arguments hpctrain can give a factory


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
                and p.name not in SUPPLIED]
    if required:
        raise ModelError(f"model.name={name!r} requires {', '.join(map(repr, required))}, which hpctrain cannot "
                         f"supply (it passes only {' and '.join(SUPPLIED)}); hint: give them defaults, "
                         "or wrap the model in a function without them")
    return {k: v for k, v in offered.items() if k in params
            and params[k].kind is not inspect.Parameter.POSITIONAL_ONLY}


def build_user_model(name: str, num_classes: int, in_channels: int | None) -> nn.Module:
    """Call the factory (or class) with the arguments it accepts; any failure is a ModelError."""
    factory = load_factory(name)
    offered = {"num_classes": num_classes} | ({} if in_channels is None else {"in_channels": in_channels})
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
                       input_dtype: torch.dtype = torch.float32) -> None:
    """One forward pass on a dummy batch of the data's shape: it runs and gives (batch, num_classes).

    Eval mode, no grad, and the RNG state restored, so the check changes neither the
    weights, the BatchNorm statistics nor the random streams of the run that follows. Token
    inputs (an embedding first) need ``input_dtype=torch.long``."""
    batch = 2
    was_training = model.training
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            out = model(torch.zeros((batch, *input_shape), dtype=input_dtype, device=device))
    except Exception as err:  # noqa: BLE001 - user code: report it with the key that named it
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelError(f"model.name={name!r} does not run on the data's input shape {tuple(input_shape)}: "
                         f"{type(err).__name__}: {first}; hint: check data.name or the model's input layer") from err
    finally:
        model.train(was_training)
    _check_logits(out, name, batch, num_classes)


def _check_logits(out: Any, name: str, batch: int, num_classes: int) -> None:
    if not isinstance(out, torch.Tensor):
        raise ModelError(f"model.name={name!r} returned a {type(out).__name__} from forward, expected a tensor "
                         "of logits or log-probabilities of shape (batch, num_classes)")
    if tuple(out.shape) != (batch, num_classes):
        raise ModelError(f"model.name={name!r} returned shape {tuple(out.shape)} for a batch of {batch}, expected "
                         f"{(batch, num_classes)} = (batch, num_classes); hint: set model.num_classes, or let the "
                         "factory take num_classes")
    if not out.is_floating_point():
        raise ModelError(f"model.name={name!r} returned {out.dtype} outputs; expected float logits")
    if out.is_meta:  # built on the meta device (FLOP counting, meta init): shapes only, no values to look at
        return
    if bool((out >= 0).all()) and torch.allclose(out.float().sum(1).cpu(), torch.ones(batch), atol=1e-4):
        log.warning("model.name=%s seems to end in softmax (outputs sum to 1): cross-entropy expects logits or "
                    "log_softmax outputs; hint: return log_softmax (or the logits)", name)
