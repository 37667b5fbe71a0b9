"""Every bad input is a message, never a traceback (issue 8, point 1).

A table of real ``python3 -m hpctrain ...`` commands with wrong input across config, data,
model, checkpoint and eval. Each must exit with the documented code (2 = bad input,
1 = failed run), print no traceback, name the culprit on stderr, and write nothing into
the workspace (the tree, sizes and mtimes are compared before and after).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.data.manifest import manifest_path
from hpctrain.data.sources import open_source
from hpctrain.data.writer import write_shards

REPO = Path(__file__).resolve().parents[1]
TINY = ["data.name=synthetic_tiny", "data.synthetic_size=64", "model.name=tests.user_models:tiny_mlp",
        "train.progress=false"]
SHARDS = ["data.name=shards", "data.path={ws}/shards", "model.name=tests.user_models:tiny_mlp", "train.max_steps=1",
          "train.progress=false", "data.stage_dir=off"]


@dataclass(frozen=True)
class Case:
    id: str
    argv: list[str]
    code: int
    culprit: str  # must appear on stderr


CASES = [
    # ---- config
    Case("garbage-yaml", ["train", "{ws}/garbage.yaml"], 2, "garbage.yaml"),
    Case("yaml-not-a-mapping", ["train", "{ws}/list.yaml"], 2, "list.yaml"),
    Case("config-file-missing", ["train", "{ws}/missing.yaml"], 2, "missing.yaml"),
    Case("config-file-is-a-dir", ["train", "{ws}/shards"], 2, "shards"),
    Case("wrong-type", ["train", *TINY, "data.batch_size=abc", "run.dir={run}"], 2, "data.batch_size"),
    Case("zero-batch", ["train", *TINY, "data.batch_size=0", "run.dir={run}"], 2, "data.batch_size"),
    Case("negative-epochs", ["train", *TINY, "train.epochs=-1", "run.dir={run}"], 2, "train.epochs"),
    Case("negative-workers", ["train", *TINY, "data.num_workers=-2", "run.dir={run}"], 2, "data.num_workers"),
    Case("unknown-key", ["train", *TINY, "data.batchsize=3", "run.dir={run}"], 2, "data.batchsize"),
    Case("section-as-value", ["train", *TINY, "data=3", "run.dir={run}"], 2, "data"),
    Case("unknown-best-metric", ["train", *TINY, "train.best_metric=val_f1", "run.dir={run}"], 2, "val_f1"),
    Case("precision-not-allowed", ["train", *TINY, "precision=fp8", "run.dir={run}"], 2, "precision"),
    Case("run-dir-is-a-file", ["train", *TINY, "run.dir={ws}/garbage.yaml/run"], 2, "garbage.yaml"),
    Case("run-dir-finished", ["train", *TINY, "run.dir={ws}/done"], 2, "done"),
    # ---- data
    Case("unknown-dataset", ["train", *TINY, "data.name=cifar11", "run.dir={run}"], 2, "cifar11"),
    Case("mnist-path-missing", ["train", "data.path={ws}/nowhere", "run.dir={run}"], 2, "nowhere"),
    Case("shards-without-path", ["train", *SHARDS, "data.path=null", "run.dir={run}"], 2, "data.path"),
    Case("shards-path-missing", ["train", *SHARDS, "data.path={ws}/nowhere", "run.dir={run}"], 2, "nowhere"),
    Case("shards-path-is-a-file", ["train", *SHARDS, "data.path={ws}/garbage.yaml", "run.dir={run}"], 2,
         "garbage.yaml"),
    Case("shards-without-manifest", ["train", *SHARDS, "data.path={ws}/empty", "run.dir={run}"], 2, "empty"),
    Case("truncated-shard", ["train", *SHARDS, "data.path={ws}/truncated", "run.dir={run}"], 2,
         "train-000000.tar"),
    Case("shards-fewer-than-a-batch", ["train", *SHARDS, "data.batch_size=64", "run.dir={run}"], 2,
         "data.batch_size"),
    Case("stage-dir-is-a-file", ["train", *SHARDS, "data.stage_dir={ws}/garbage.yaml", "run.dir={run}"], 2,
         "garbage.yaml"),
    Case("data-verify-missing-dir", ["data", "verify", "{ws}/nowhere"], 2, "nowhere"),
    Case("data-shard-missing-source", ["data", "shard", "npz:{ws}/nowhere.npz", "{ws}/out"], 2, "nowhere.npz"),
    # ---- model
    Case("model-factory-raises", ["train", *TINY, "model.name=tests.user_models:raises", "run.dir={run}"], 2,
         "tests.user_models:raises"),
    Case("model-not-a-module", ["train", *TINY, "model.name=tests.user_models:not_a_module", "run.dir={run}"], 2,
         "model.name"),
    Case("model-wrong-output-shape", ["train", *TINY, "model.name=tests.user_models:three_classes", "run.dir={run}"],
         2, "model.name"),
    Case("model-wrong-input-shape", ["train", *TINY, "data.name=synthetic_cifar", "run.dir={run}"], 2,
         "model.name"),
    Case("model-module-missing", ["train", *TINY, "model.name=no_such_pkg:f", "run.dir={run}"], 2,
         "no_such_pkg"),
    # ---- checkpoint
    Case("resume-path-missing", ["train", *TINY, "resume={ws}/nowhere", "run.dir={run}"], 2, "nowhere"),
    Case("resume-other-model", ["train", *TINY, "model.name=tests.user_models:TinyNet", "resume={ws}/done/checkpoints",
                                "run.dir={run}"], 2, "checkpoints"),
    Case("ckpt-verify-not-a-checkpoint", ["ckpt", "verify", "{ws}/garbage.yaml"], 2, "garbage.yaml"),
    Case("resume-path-is-a-file", ["train", *TINY, "resume={ws}/garbage.yaml", "run.dir={run}"], 2, "garbage.yaml"),
    Case("ckpt-list-missing-dir", ["ckpt", "list", "{ws}/nowhere"], 2, "nowhere"),
    Case("ckpt-export-not-a-checkpoint", ["ckpt", "export", "{ws}/empty", "{ws}/out.pt"], 2, "empty"),
    # ---- eval
    Case("eval-weights-missing", ["eval", *TINY, "--weights", "{ws}/nowhere.pt"], 2, "nowhere.pt"),
    Case("eval-weights-not-torch", ["eval", *TINY, "--weights", "{ws}/garbage.yaml"], 2, "garbage.yaml"),
    Case("eval-weights-not-a-state-dict", ["eval", *TINY, "--weights", "{ws}/list.pt"], 2, "list.pt"),
    Case("eval-weights-a-directory", ["eval", *TINY, "--weights", "{ws}/empty"], 2, "empty"),
    Case("eval-out-is-a-file", ["eval", *TINY, "--weights", "{ws}/done/model.pt", "--out", "{ws}/list.pt"], 2,
         "list.pt"),
    Case("eval-weights-other-model", ["eval", *TINY, "model.name=tests.user_models:TinyNet", "--weights",
                                      "{ws}/done/model.pt"], 2, "model.pt"),
]


def _hpctrain(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return subprocess.run([sys.executable, "-m", "hpctrain", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with (size, mtime_ns): a new, removed or rewritten file shows."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(root))] = (st.st_size if path.is_file() else -1, st.st_mtime_ns)
    return out


def _write_tiny_shards(root: Path, split: str, n: int) -> None:
    gen = np.random.default_rng(0)
    arrays = root.parent / f"{root.name}-{split}.npz"
    np.savez(arrays, x=gen.standard_normal((n, 128)).astype(np.float32), y=np.arange(n) % 10)
    source = open_source(f"npz:{arrays}", split)
    write_shards(source.samples, root, split, samples_per_shard=16, meta=source.meta)
    arrays.unlink()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ws = tmp_path_factory.mktemp("bad-inputs")
    (ws / "garbage.yaml").write_text("data: [batch_size: 3\n  :: {\n")
    (ws / "list.yaml").write_text("- 1\n- 2\n")
    (ws / "empty").mkdir()
    torch.save([1, 2, 3], ws / "list.pt")
    for split in ("train", "val"):
        _write_tiny_shards(ws / "shards", split, 48)
        _write_tiny_shards(ws / "truncated", split, 48)
    tar = ws / "truncated" / "train-000000.tar"
    tar.write_bytes(tar.read_bytes()[:700])  # cut inside the first sample
    assert manifest_path(ws / "truncated", "train").is_file()
    done = _hpctrain(["train", *TINY, "train.max_steps=2", "data.batch_size=8", f"run.dir={ws / 'done'}"], ws)
    assert done.returncode == 0, done.stderr
    return ws


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_a_message_not_a_traceback(case: Case, workspace: Path) -> None:
    argv = [a.format(ws=workspace, run=workspace / f"run-{case.id}") for a in case.argv]
    before = _tree(workspace)
    result = _hpctrain(argv, workspace)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == case.code, result.stderr
    assert case.culprit in result.stderr, result.stderr
    assert _tree(workspace) == before, "the failed command left files behind"


def test_the_table_is_broad() -> None:
    assert len(CASES) >= 20
    assert {c.argv[0] for c in CASES} >= {"train", "eval", "ckpt", "data"}
