"""DDP on real gloo ranks equals one process with the global batch; accumulation equals a big batch."""

import contextlib
import json
from pathlib import Path

import numpy as np
import torch

from hpctrain.config import load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.parallel import unwrap
from hpctrain.planning.layout import make_layout
from hpctrain.train import build_components, fit, load_data
from tests.dist_utils import run_ranks, train_cases

STEPS = 10


def _cfg(batch_size: int, grad_accum: int, extra: tuple[str, ...]):
    return load_config(None, [
        "model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=1024",
        f"data.batch_size={batch_size}", f"train.grad_accum={grad_accum}", f"train.max_steps={STEPS}",
        "train.progress=false", "train.eval_each_epoch=false", "optim.name=sgd", "optim.lr=0.1",
        "optim.momentum=0.9", "optim.schedule=constant", "precision=fp32", "seed=7", *extra,
    ])


def _train_weights(env, batch_size: int, grad_accum: int = 1, extra: tuple[str, ...] = ()) -> dict:
    cfg = _cfg(batch_size, grad_accum, extra)
    device = torch.device("cpu")
    parts = build_components(cfg, env, device, load_data(cfg, env, device, with_val=False))
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


def _count_allreduced_backwards(env, grad_accum: int) -> tuple[int, int]:
    """(optimizer steps, backward passes whose gradients DDP all-reduced), seen by a comm hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    cfg = _cfg(8, grad_accum, ())
    device = torch.device("cpu")
    parts = build_components(cfg, env, device, load_data(cfg, env, device, with_val=False))
    reduced = []

    def counting_hook(state, bucket):  # bucket 0 is reduced once per synchronized backward
        if bucket.index() == 0:
            reduced.append(1)
        return allreduce_hook(state, bucket)

    parts.model.register_comm_hook(None, counting_hook)
    fit(cfg, env, device, parts)
    return parts.counters.step, len(reduced)


def test_accumulation_all_reduces_once_per_optimizer_step():
    """Fails if no_sync is dropped: every micro-step would all-reduce (2 x as many)."""
    for steps, reduced in run_ranks(2, _count_allreduced_backwards, 2):
        assert steps == STEPS and reduced == STEPS
    for steps, reduced in run_ranks(2, _count_allreduced_backwards, 1):
        assert steps == STEPS and reduced == STEPS


def _clipped_norms(env, clip: float) -> list[float]:
    """The global gradient norm the optimizer sees at every step (after clipping)."""
    cfg = _cfg(4, 2, (f"train.clip_grad_norm={clip}",))
    device = torch.device("cpu")
    parts = build_components(cfg, env, device, load_data(cfg, env, device, with_val=False))
    norms: list[float] = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    parts.optimizer.register_step_pre_hook(record)
    fit(cfg, env, device, parts)
    return norms


def test_clipping_limits_the_global_norm_the_optimizer_sees():
    """Fails if clipping does nothing: unclipped norms of this model are far above 1e-2."""
    unclipped = run_ranks(1, _clipped_norms, 1e6)[0]
    assert len(unclipped) == STEPS and min(unclipped) > 0.1
    ranks = run_ranks(2, _clipped_norms, 1e-2)
    for norms in ranks:
        assert len(norms) == STEPS and all(abs(n - 1e-2) < 1e-6 for n in norms), norms
    assert ranks[0] == ranks[1]  # clipped after the all-reduce: the same norm on every rank


def test_inner_micro_steps_skip_the_gradient_sync():
    """The DDP strategy's micro-step enters DDP's no_sync() on inner micro-steps of accumulation
    only, and the last one (sync=True) all-reduces as usual."""
    from torch.nn.parallel import DistributedDataParallel

    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.core.topology import Topology
    from hpctrain.parallel.ddp import DDP

    class Fake(DistributedDataParallel):
        def __init__(self):  # no process group needed to check the dispatch
            torch.nn.Module.__init__(self)
            self.inner, self.entered = torch.nn.Linear(4, 2), 0

        def forward(self, x):
            return self.inner(x)

        def no_sync(self):
            self.entered += 1
            return contextlib.nullcontext()

    strategy = DDP(Topology(), ClusterEnv(), torch.device("cpu"), ParallelConfig())
    strategy.model, strategy.loss_fn = Fake(), lambda out, target, mask: out.sum()
    inputs, targets = torch.ones(3, 4), torch.zeros(3)
    strategy.micro_step(inputs, targets, None, sync=False, accum=2)
    assert strategy.model.entered == 1
    strategy.micro_step(inputs, targets, None, sync=True, accum=2)
    assert strategy.model.entered == 1


# ---------------------------------------------------------------- elastic resume keeps the global batch


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_resume_at_another_world_size_keeps_global_batch_and_losses(tmp_path):
    """World 2 (16 per rank: 2 micro-steps of 8) -> resume at world 4 (8 per rank, 1 micro-step):
    the resumed steps see the same samples per step, so their losses equal the world-2 run's."""
    from hpctrain.data.files import npz_source
    from hpctrain.data.writer import write_shards

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((384, 128)).astype(np.float32),
             y=rng.integers(0, 10, 384))
    source = npz_source(str(tmp_path / "data.npz"), "train")
    write_shards(source.samples, tmp_path / "shards", "train", samples_per_shard=100, meta=source.meta)
    common = ["model.name=tests.user_models:tiny_mlp", "data.name=shards", f"data.path={tmp_path / 'shards'}",
              "data.shuffle=global", "data.global_batch_size=32", "data.batch_size=8", "train.max_steps=8",
              "train.log_every=1", "train.progress=false", "train.eval_each_epoch=false", "train.threads=1",
              "optim.schedule=constant", "optim.lr=0.2", "checkpoint.every_seconds=off", "seed=3"]
    for world, accum in ((2, 2), (4, 1)):  # the layout each world size trains with
        _, layout = make_layout(load_config(None, common), ClusterEnv(world_size=world, rank=0))
        assert (layout.global_batch, layout.micro_batch, layout.grad_accum) == (32, 8, accum)
    # forked ranks (the launchers are tested in tests/launch, tests/data/test_loader.py's torchrun run)
    two = train_cases(2, [("w2", [*common, "checkpoint.every_steps=4", "checkpoint.keep_last=5"])], tmp_path)
    assert isinstance(two[0]["w2"], dict), two[0]
    ckpt = tmp_path / "w2" / "checkpoints" / "step-000000004"
    four = train_cases(4, [("w4", [*common, f"resume={ckpt}"])], tmp_path)[0]["w4"]
    assert isinstance(four, dict) and four["world_size"] == 4 and four["samples_seen"] == 8 * 32, four
    reference, resumed = _losses(tmp_path / "w2"), _losses(tmp_path / "w4")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, loss in resumed.items():
        assert abs(loss - reference[step]) <= 1e-5, (step, loss, reference[step])
    assert len({round(v, 4) for v in resumed.values()}) == 4  # it trained: the losses move
