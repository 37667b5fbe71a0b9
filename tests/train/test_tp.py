"""Tensor parallelism through the trainer (gloo, CPU, forked ranks): tp2 (with and without sequence
parallel) and dp2 x tp2 (FSDP over dp) train the tiny GPT to the same losses as one process,
count every validation sample and every training sample once, and a tp2 checkpoint (DCP)
resumes at dp2 x tp2 with the data position kept. A model without transformer blocks fails
before start, naming the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.data.in_memory import EvalLoader
from hpctrain.data.synthetic import synthetic
from hpctrain.evaluation.evaluate import evaluate
from hpctrain.parallel import mesh_for
from hpctrain.parallel.mesh import dp_group
from hpctrain.planning.layout import layout_for, make_layout
from hpctrain.tasks.metrics import default_metrics
from hpctrain.train import train
from tests.data.test_text import needs_sdist
from tests.dist_utils import ROOT, launch_env, run_ranks, train_cases
from tests.gpt_runs import assert_close, read_summary, step_losses
from tests.user_models import tiny_mlp

TOL = 1e-5
STEPS = 6
# 16 samples a step: 4 micro-steps of 4 at one process and at tp2 (one replica), 2 at dp2 x tp2;
# 41 validation samples: 21 + 20 at dp2, so the replicas run 6 and 5 eval batches (FSDP keeps in step)
BASE = ["model.name=gpt", "model.n_layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=32",
        "data.name=shards", "data.batch_size=4", "data.global_batch_size=16", "data.max_val_samples=41",
        "data.eval_batch_size=4", f"train.max_steps={STEPS}", "train.log_every=1", "train.progress=false",
        "train.threads=1", "train.clip_grad_norm=0.5", "optim.name=adamw", "optim.lr=0.01",
        "optim.schedule=constant", "checkpoint.every_seconds=None"]


def _same_counts(run: Path, one: Path, world: int) -> None:
    """Exact validation (each sample once, the one-process loss) and a global batch counted once."""
    mine, ref = read_summary(run), read_summary(one)
    assert mine["world_size"] == world
    assert mine["val_count"] == ref["val_count"] == 41
    assert abs(mine["val_loss"] - ref["val_loss"]) < TOL, (mine["val_loss"], ref["val_loss"])
    assert mine["samples_seen"] == ref["samples_seen"] == 16 * STEPS
    # tokens per sample from the meter: the replica's tokens, not tp times them
    per_sample = [s["tokens_per_s"] / s["samples_per_s"] for s in (mine, ref)]
    assert per_sample[0] == pytest.approx(per_sample[1], rel=1e-9)


@pytest.fixture(scope="module")
def one_process(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("one") / "run"
    train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={run}", "checkpoint.enabled=false"]))
    return run


SP_META_AC = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.strategy=fsdp", "parallel.meta_init=true",
              "parallel.activation_checkpointing=block"]
STEP3 = Path("checkpoints") / "step-000000003"


def _trained(world: int, shards: Path, root: Path, cases: list[tuple[str, list[str]]]) -> Path:
    ranks = train_cases(world, [(name, [*BASE, f"data.path={shards}", *keys]) for name, keys in cases], root,
                        keep=("steps",))
    failed = {name: got for name, got in ranks[0].items() if not isinstance(got, dict)}
    assert not failed, failed
    return root


@pytest.fixture(scope="module")
def two_ranks(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """On one forked pair of ranks: tp2 at world 2 (one replica), checkpointing at step 3 (DCP:
    tensor-parallel state is sharded); tp2 with sequence parallel, built on meta (tied embedding
    and head shared again after to_empty: no FSDP at dp=1 keeps them tied) and block activation
    checkpointing."""
    return _trained(2, shards, tmp_path_factory.mktemp("tp2"), [
        ("tp2", ["parallel.tp=2", "checkpoint.every_steps=3"]),
        ("sp-meta-ac-tp2", [*SP_META_AC, "checkpoint.enabled=false"])])


@pytest.fixture(scope="module")
def four_ranks(shards: Path, two_ranks: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """On one forked set of 4 ranks: FSDP over dp2 x tp2 (the same global batch), and the tp2
    checkpoint resumed there."""
    return _trained(4, shards, tmp_path_factory.mktemp("tp4"), [
        ("dp2xtp2", ["parallel.tp=2", "parallel.strategy=fsdp", "checkpoint.enabled=false"]),
        ("at4", ["parallel.tp=2", "parallel.strategy=fsdp", f"resume={two_ranks / 'tp2' / STEP3}"])])


@pytest.fixture(scope="module")
def tp2(two_ranks: Path) -> Path:
    return two_ranks / "tp2"


def _data_env(cfg, env):  # type: ignore[no-untyped-def]
    """The world the data sees: one rank per data-parallel replica (the run's layout, hpctrain.planning.layout)."""
    return layout_for(cfg.parallel, env).data_env(env)


def test_data_env_is_the_dp_coordinate() -> None:
    """The data sees one rank per replica ((pp, dp, tp) mesh, tp innermost); node fields stay the
    process's own, so node-once staging still runs on each node's local rank 0."""
    cfg = load_config(None, [*BASE, "parallel.strategy=fsdp", "parallel.tp=2"])
    envs = [_data_env(cfg, ClusterEnv(rank=r, local_rank=r % 2, world_size=4, local_world_size=2, node_rank=r // 2,
                                     num_nodes=2)) for r in range(4)]
    assert [(e.rank, e.world_size) for e in envs] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [(e.local_rank, e.local_world_size, e.node_rank, e.num_nodes) for e in envs] == [
        (0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    plain = load_config(None, BASE)
    env = ClusterEnv(rank=3, local_rank=3, world_size=4, local_world_size=4)
    assert _data_env(plain, env) is env


@needs_sdist
def test_tp2_matches_one_process(tp2: Path, one_process: Path) -> None:
    want = step_losses(one_process)
    assert len(want) == STEPS and want[STEPS] < want[1]
    assert_close(step_losses(tp2), want)
    _same_counts(tp2, one_process, world=2)
    manifest = json.loads((tp2 / "checkpoints" / "step-000000003" / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and manifest["world_size"] == 2


@needs_sdist
@pytest.mark.parametrize(("world", "name"), [(2, "sp-meta-ac-tp2"), (4, "dp2xtp2")], ids=["sp-meta-ac-tp2", "dp2xtp2"])
def test_tensor_parallel_variants_match_one_process(one_process: Path, request: pytest.FixtureRequest, world: int,
                                                   name: str) -> None:
    run = request.getfixturevalue("two_ranks" if world == 2 else "four_ranks") / name
    assert_close(step_losses(run), step_losses(one_process))
    _same_counts(run, one_process, world=world)


@needs_sdist
def test_tp2_checkpoint_resumes_at_dp2_x_tp2(tp2: Path, four_ranks: Path) -> None:
    """Saved at world 2 (tp2), resumed at world 4 (FSDP over dp2 x tp2): the loader's global
    position carries over (each replica takes its half of the next batches) and the next steps'
    losses are the uninterrupted tp2 run's."""
    run = four_ranks / "at4"
    want = {s: v for s, v in step_losses(tp2).items() if s > 3}
    assert_close(step_losses(run), want)  # the same batches (the data position kept) and the same weights
    assert read_summary(run)["samples_seen"] == read_summary(tp2)["samples_seen"] == 16 * STEPS


def _eval_replicas(env: ClusterEnv) -> dict:
    """The one replica of a tp2 mesh evaluates all samples on both of its ranks (as tp ranks
    do), merged over the mesh's dp group (of one rank)."""
    cfg = load_config(None, ["parallel.tp=2"])
    mesh = mesh_for(env, cfg.parallel)[1]
    torch.manual_seed(0)
    model, data = tiny_mlp(10), synthetic("val", 101, (128,), seed=1)
    result = evaluate(model, EvalLoader(data, _data_env(cfg, env), 8), default_metrics(10), env, torch.device("cpu"),
                      collect_predictions=True, group=dp_group(mesh))
    return {"count": result.metrics["count"], "correct": result.metrics["correct"],
            "keys": [row["key"] for row in result.predictions]}


def test_evaluation_merges_each_replica_once() -> None:
    torch.manual_seed(0)
    data = synthetic("val", 101, (128,), seed=1)
    one = evaluate(tiny_mlp(10), EvalLoader(data, ClusterEnv(), 8), default_metrics(10), ClusterEnv(),
                   torch.device("cpu")).metrics
    results = run_ranks(2, _eval_replicas)
    assert [r["count"] for r in results] == [101] * 2  # not 202: the tp ranks' copies are not merged
    assert [r["correct"] for r in results] == [one["correct"]] * 2
    assert sorted(results[0]["keys"]) == sorted(set(results[0]["keys"])) and len(results[0]["keys"]) == 101
    assert results[1]["keys"] == []  # predictions on rank 0 only, once


def test_tp_on_a_model_without_blocks_fails_before_start(tmp_path: Path) -> None:
    """Rank 0 of a 2-rank job alone: it exits 2 naming the model before the process group (it
    would wait for rank 1 otherwise), and leaves no run directory behind."""
    run, model = tmp_path / "run", "resnet18"
    env = launch_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="1")
    cmd = [sys.executable, "-m", "hpctrain", "train", f"model.name={model}", "data.name=synthetic_cifar",
           "parallel.tp=2", f"run.dir={run}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"parallel.tp=2 cannot split model.name={model}" in proc.stderr
    assert "has none" in proc.stderr and "Traceback" not in proc.stderr
    assert not run.exists()


def test_tp_checks_name_the_numbers() -> None:
    """Another model without blocks, heads that tp does not divide, and a world that is not
    dp x tp fail before start."""
    two = ClusterEnv(world_size=2, local_world_size=2)
    cnn = load_config(None, ["model.name=simple_cnn", "data.name=synthetic_cifar", "parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"parallel.tp=2 cannot split model.name=simple_cnn: .* SimpleCNN has none"):
        make_layout(cnn, two)
    heads = load_config(None, [*BASE, "model.heads=1", "model.hidden=32", "parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"model.name=gpt: blocks.0.attn has 1 heads, not divisible by tp=2"):
        make_layout(heads, two)
    three = ClusterEnv(world_size=3, local_world_size=3)
    with pytest.raises(ConfigError, match=r"= 2 != world size 3"):
        make_layout(load_config(None, [*BASE, "parallel.tp=2"]), three)
    fp16 = load_config(None, [*BASE, "parallel.tp=2", "precision=fp16"])
    with pytest.raises(ConfigError, match=r"precision=fp16 with parallel.tp=2 needs .* \(got dp=1, strategy=ddp\)"):
        make_layout(fp16, two)
    compiled = load_config(None, [*BASE, "parallel.tp=2", "train.compile=true",
                                  "parallel.activation_checkpointing=block"])
    with pytest.raises(ConfigError, match=r"hint: parallel.activation_checkpointing=none, or train.compile=false"):
        make_layout(compiled, two)
    make_layout(load_config(None, [*BASE, "parallel.tp=2"]), two)
