"""evaluate() names no strategy: a wrapper's evaluation view is registered by the layer that
makes the wrapper, and evaluate() asks for it; a replicating wrapper (``.module`` and
``.process_group``, as torch's DDP) needs no registration. Its view sets every rank's buffers
to rank 0's first (what its next training forward would do), so every rank validates the model
rank 0 saves: also for a DDP the user made, with no hpctrain.parallel module imported."""

from __future__ import annotations

import torch
from torch import nn

from hpctrain.core import modules
from hpctrain.core.env import ClusterEnv
from hpctrain.data.in_memory import EvalLoader
from hpctrain.data.synthetic import synthetic
from hpctrain.evaluation.evaluate import evaluate
from hpctrain.tasks.metrics import MeanLoss
from tests.dist_utils import run_ranks


class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def test_a_registered_wrapper_is_evaluated_through_its_view(monkeypatch) -> None:
    monkeypatch.setattr(modules, "_EVAL_VIEWS", {})
    plain = nn.Linear(2, 2)
    assert modules.eval_view(plain) is plain
    modules.register_eval_view(_Wrapper, lambda model: model.inner)
    wrapped = _Wrapper(plain)
    assert modules.eval_view(wrapped) is plain
    assert modules.eval_view(type("Sub", (_Wrapper,), {})(plain)) is plain  # a subclass too


def _ddp_eval(env: ClusterEnv) -> tuple[float, list[float]]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 10))
    ddp = DistributedDataParallel(model)  # the user's own DDP
    assert not modules._EVAL_VIEWS  # no registration: the replicating wrapper's own view
    model[1].running_mean.fill_(float(env.rank))  # each rank's own statistics, as training leaves them
    data = synthetic("val", 40, (8,), seed=1)
    result = evaluate(ddp, EvalLoader(data, env, 8), [MeanLoss()], env, torch.device("cpu"))
    return result.metrics["loss"], model[1].running_mean.tolist()


def test_a_ddp_model_is_validated_with_rank_0s_buffers() -> None:
    (loss0, mean0), (loss1, mean1) = run_ranks(2, _ddp_eval)
    assert mean0 == mean1 == [0.0] * 8  # rank 1's statistics replaced by rank 0's before the forwards
    assert loss0 == loss1
