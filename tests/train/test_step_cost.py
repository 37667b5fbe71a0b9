"""The step costs what a hand-written one does (issue 43): the non-finite watch reads the clip's
norm (no pass of its own), the loop's clip is the strategy's bit for bit, the built-in optimizers
take torch's multi-tensor kernels with the same numbers, optim.decay=matrices."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import hpctrain.train as trainer
from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.optim import build_optimizer
from hpctrain.parallel import unwrap
from hpctrain.precision import NonFiniteError
from hpctrain.train import build_components, fit, load_data
from tests.train.test_nonfinite import BASE, FLAKY, _arm

CLIP = [*BASE, "train.clip_grad_norm=0.05", "train.max_steps=4"]


def _trained(*extra: str) -> tuple[dict[str, torch.Tensor], object]:
    """(the weights after, fit's result or its NonFiniteError); asserts who clipped."""
    cfg = load_config(None, [*CLIP, *extra])
    env, device = ClusterEnv(), torch.device("cpu")
    parts = build_components(cfg, env, device, load_data(cfg, env, device, with_val=False))
    try:
        outcome: object = fit(cfg, env, device, parts)
    except NonFiniteError as err:
        outcome = err
    return {k: v.detach().clone() for k, v in unwrap(parts.model).state_dict().items()}, outcome


def _clipper() -> float | None:
    cfg = load_config(None, CLIP)
    env, device = ClusterEnv(), torch.device("cpu")
    return build_components(cfg, env, device, load_data(cfg, env, device, with_val=False)).strategy.max_norm


def test_the_loops_clip_is_the_strategys_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _clipper() is None  # the loop clips
    ours, _ = _trained()
    monkeypatch.setattr(trainer, "loop_clips", lambda strategy: False)
    assert _clipper() == 0.05  # the strategy clips, as before issue 43
    theirs, _ = _trained()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_with_clipping_the_watch_reads_no_gradient_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pass(params: object) -> torch.Tensor:
        raise AssertionError("a second pass over the gradients")

    monkeypatch.setattr(trainer, "local_grad_norm", no_pass)
    _arm({2})
    _, err = _trained(FLAKY)
    assert isinstance(err, NonFiniteError)
    assert str(err).startswith("step 2: the loss is nan and the largest gradient is nan;")


def test_an_overflowing_norm_of_finite_gradients_is_judged_by_their_largest_magnitude() -> None:
    weight = nn.Parameter(torch.zeros(4))
    weight.grad = torch.full((4,), 1e30)  # finite; their squares overflow fp32
    loop = SimpleNamespace(params=[weight], env=ClusterEnv())
    assert trainer.local_grad_norm([weight]).item() == math.inf
    assert trainer._exact(loop, [2.0, math.inf]) == [2.0, pytest.approx(1e30)]  # a finite step
    weight.grad[1] = math.inf
    assert trainer._exact(loop, [2.0, math.inf]) == [2.0, math.inf]
    assert trainer._exact(loop, [2.0, 3.5]) == [2.0, 3.5]  # a finite norm: no second pass


def test_decay_matrices_groups_and_foreach_keeps_the_numbers() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    cfg = load_config(None, ["optim.name=adamw", "optim.weight_decay=0.1", "optim.decay=matrices"]).optim
    optimizer = build_optimizer(model, cfg, 0.01)
    decayed, plain = optimizer.param_groups
    assert [p.ndim for p in decayed["params"]] == [2, 2] and decayed["weight_decay"] == 0.1
    assert [p.ndim for p in plain["params"]] == [1, 1, 1, 1] and plain["weight_decay"] == 0.0
    assert len(build_optimizer(model, load_config(None, []).optim, 0.1).param_groups) == 1  # default: all
    with pytest.raises(ConfigError, match=r"^optim.decay=matrices applies to the built-in optimizers"):
        load_config(None, ["optim.name=torch.optim:Adadelta", "optim.decay=matrices"])


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_foreach_gives_the_for_loops_weights(name: str) -> None:
    cfg = load_config(None, [f"optim.name={name}", "optim.weight_decay=0.01"]).optim
    weights = []
    for foreach in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        optimizer = build_optimizer(model, cfg, 0.01)
        for group in optimizer.param_groups:
            group["foreach"] = foreach
        for _ in range(3):
            model(torch.randn(8, 16)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])
