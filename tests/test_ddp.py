"""DDP on real gloo ranks equals one process with the global batch; accumulation equals a big batch."""

import torch

from hpctrain.config import load_config
from hpctrain.data import build_data
from hpctrain.parallel import unwrap
from hpctrain.train import build_components, fit
from tests.dist_utils import run_ranks

STEPS = 10


def _train_weights(env, batch_size: int, grad_accum: int = 1, extra: tuple[str, ...] = ()) -> dict:
    cfg = load_config(None, [
        "model.name=tests.models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=1024",
        f"data.batch_size={batch_size}", f"train.grad_accum={grad_accum}", f"train.max_steps={STEPS}",
        "train.progress=false", "train.eval_each_epoch=false", "optim.name=sgd", "optim.lr=0.1",
        "optim.momentum=0.9", "optim.schedule=constant", "precision=fp32", "seed=7", *extra,
    ])
    device = torch.device("cpu")
    parts = build_components(cfg, env, device, build_data(cfg, env, device, with_val=False))
    initial = {k: v.detach().clone() for k, v in unwrap(parts.model).state_dict().items()}
    fit(cfg, env, device, parts)
    assert parts.counters.step == STEPS
    assert _max_diff(initial, unwrap(parts.model).state_dict()) > 1e-3  # it really trained
    return {k: v.detach().clone() for k, v in unwrap(parts.model).state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_ddp_two_ranks_equal_one_process_with_double_batch():
    single = run_ranks(1, _train_weights, 16)[0]
    per_rank = run_ranks(2, _train_weights, 8)
    assert _max_diff(per_rank[0], per_rank[1]) == 0.0  # replicas stay identical
    assert _max_diff(single, per_rank[0]) <= 1e-6


def test_ddp_with_accumulation_and_clipping_equals_one_process():
    single = run_ranks(1, _train_weights, 16, 1, ("train.clip_grad_norm=0.5",))[0]
    per_rank = run_ranks(2, _train_weights, 4, 2, ("train.clip_grad_norm=0.5",))
    assert _max_diff(single, per_rank[0]) <= 1e-6


def test_gradient_accumulation_equals_one_big_step():
    big = run_ranks(1, _train_weights, 16, 1)[0]
    accumulated = run_ranks(1, _train_weights, 8, 2)[0]
    assert _max_diff(big, accumulated) <= 1e-6


def test_accumulation_skips_allreduce_on_inner_micro_steps(monkeypatch):
    from torch.nn.parallel import DistributedDataParallel

    from hpctrain.parallel.ddp import no_sync

    class Fake(DistributedDataParallel):
        def __init__(self):  # no process group needed to check the dispatch
            torch.nn.Module.__init__(self)
            self.entered = 0

        def no_sync(self):
            self.entered += 1
            return torch.autograd.grad_mode.no_grad()

    fake = Fake()
    with no_sync(fake, skip=True):
        pass
    with no_sync(fake, skip=False):
        pass
    assert fake.entered == 1
