"""Every bad input is a message, never a traceback (issue 8, point 1).

A table of ``hpctrain ...`` commands with wrong input across config, data, model,
checkpoint and eval. Each must exit with the documented code (2 = bad input, 1 = failed
run), print no traceback, name the culprit on stderr, and write nothing into the workspace
(the tree, sizes and mtimes are compared before and after).

Every case runs in this process through the CLI's own entry point, ``hpctrain.cli.main``,
as a fresh ``hpctrain`` process would: its working directory and environment, stdout and
stderr captured at the file descriptors (so C++ warnings and DataLoader workers count
too), the CLI's own logging set-up writing to that stderr, an uncaught exception printed
as the interpreter prints it, and whatever a run changes in the process (root logger,
signal handlers, torch threads and RNGs, environment) put back afterwards. A few cases, one
per way out of the CLI, also run as real processes (``python -m hpctrain`` and the
installed ``hpctrain`` script), so the process level (exit status, stderr) stays tested
(the full table as processes took minutes; in-process it takes seconds).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.cli import main
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
    # the same command as the finished run (dropping its train.max_steps would continue it: the epochs allow more)
    Case("run-dir-finished", ["train", *TINY, "train.max_steps=2", "data.batch_size=8", "run.dir={ws}/done"], 2,
         "done"),
    # ---- data
    Case("unknown-dataset", ["train", *TINY, "data.name=cifar11", "run.dir={run}"], 2, "cifar11"),
    Case("mnist-path-missing", ["train", "data.path={ws}/nowhere", "run.dir={run}"], 2, "nowhere"),
    Case("mnist-path-not-gzip", ["train", "data.path={ws}/garbage.yaml", "run.dir={run}"], 2,
         "garbage.yaml is not MNIST's mnist.pkl.gz"),
    Case("mnist-path-another-archive", ["data", "shard", "mnist:{ws}/list.pt", "{ws}/out"], 2,
         "list.pt is not MNIST's mnist.pkl.gz"),
    Case("mnist-path-dir-without-mnist", ["train", "data.path={ws}/empty", "run.dir={run}"], 2, "mnist.pkl.gz"),
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


# Also run as real processes, one per way out: a config file that does not parse (config
# loading, before any data or model is touched), a shard cut mid-sample (the data layer, after the run
# directory was created and the preemption signal handlers installed: both undone on the way
# out), both as `python -m hpctrain`; and eval of another model's weights through the installed
# `hpctrain` console script (its own entry point: sys.exit(main())). None of the cases needs a
# process of its own (no process group, signal or environment read at import is involved).
AS_PROCESS = {"garbage-yaml": "module", "truncated-shard": "module", "eval-weights-other-model": "script"}

_LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# what a run may change in its process: a fresh one for every case gets them back afterwards
_SIGNALS = [getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT") if hasattr(signal, name)]


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def _hpctrain(argv: list[str], cwd: Path, how: str = "module") -> Outcome:
    """``python -m hpctrain ARGV`` (how=module) or the installed ``hpctrain`` script (how=script)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    for name in _LAUNCHER:
        env.pop(name, None)
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    if how == "script":
        script = Path(sys.executable).parent / "hpctrain"  # the console script installed next to this python
        assert script.is_file(), f"{script}: the hpctrain console script is not installed (pip install -e .)"
        cmd = [str(script), *argv]
    else:
        cmd = [sys.executable, "-m", "hpctrain", *argv]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    return Outcome(done.returncode, done.stdout, done.stderr)


@contextlib.contextmanager
def _as_a_fresh_process() -> Iterator[None]:
    """Run the CLI as if in a process of its own: the root logger starts without handlers (so
    the CLI's ``logging.basicConfig`` installs its stderr handler, as it does in a real
    process; under pytest it would find pytest's and do nothing), and what the run changes
    in the process is put back afterwards (a real process would just exit)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    environ = dict(os.environ)
    handlers_by_signal = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    threads = torch.get_num_threads()
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    rngs = random.getstate(), np.random.get_state(), torch.get_rng_state()
    root.handlers.clear()
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        if os.environ != environ:
            os.environ.clear()
            os.environ.update(environ)
        for sig, handler in handlers_by_signal.items():
            if handler is not None:
                signal.signal(sig, handler)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        random.setstate(rngs[0])
        np.random.set_state(rngs[1])
        torch.set_rng_state(rngs[2])


def _main(argv: list[str]) -> int:
    """``hpctrain.cli.main`` and what the interpreter makes of its end: the exit status
    (argparse exits with SystemExit), or an uncaught exception's traceback on stderr and 1."""
    try:
        return main(argv)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - what python does with it: the traceback, exit status 1
        traceback.print_exc()
        return 1


@pytest.fixture
def hpctrain_in_process(monkeypatch: pytest.MonkeyPatch,
                        capfd: pytest.CaptureFixture[str]) -> Callable[[list[str], Path], Outcome]:
    """``run(argv, cwd)``: ``hpctrain ARGV`` in this process, with the environment the
    subprocess gets (no launcher variables: tests/conftest.py removes them), its working
    directory, and its stdout/stderr (file descriptors: C++ warnings and DataLoader workers
    included; a dying thread prints its traceback there, as in a real process)."""

    def run(argv: list[str], cwd: Path) -> Outcome:
        monkeypatch.chdir(cwd)
        monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.setattr(sys, "dont_write_bytecode", True)
        monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
        capfd.readouterr()  # drop anything printed before the command
        with _as_a_fresh_process():
            code = _main(argv)
        out, err = capfd.readouterr()
        return Outcome(code, out, err)

    return run


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
    """Read-only for the cases (each checks that it changed nothing), so built once."""
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
    # a finished run (to resume from, and weights to evaluate), trained in this process too
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, _as_a_fresh_process(), contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        mp.chdir(ws)
        mp.setenv("OMP_NUM_THREADS", "1")
        code = _main(["train", *TINY, "train.max_steps=2", "data.batch_size=8", f"run.dir={ws / 'done'}"])
    assert code == 0, err.getvalue()
    assert (ws / "done" / "model.pt").is_file(), err.getvalue()
    return ws


def _check(case: Case, workspace: Path, run: Callable[[list[str], Path], Outcome]) -> None:
    argv = [a.format(ws=workspace, run=workspace / f"run-{case.id}") for a in case.argv]
    before = _tree(workspace)
    result = run(argv, workspace)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == case.code, result.stderr
    assert case.culprit in result.stderr, result.stderr
    assert _tree(workspace) == before, "the failed command left files behind"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_a_message_not_a_traceback(case: Case, workspace: Path,
                                                hpctrain_in_process: Callable[[list[str], Path], Outcome]) -> None:
    _check(case, workspace, hpctrain_in_process)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in AS_PROCESS], ids=lambda c: c.id)
def test_bad_input_in_a_real_process(case: Case, workspace: Path) -> None:
    _check(case, workspace, lambda argv, cwd: _hpctrain(argv, cwd, AS_PROCESS[case.id]))


def test_the_table_is_broad() -> None:
    assert len(CASES) >= 20
    assert {c.argv[0] for c in CASES} >= {"train", "eval", "ckpt", "data"}
    assert set(AS_PROCESS) <= {c.id for c in CASES}
